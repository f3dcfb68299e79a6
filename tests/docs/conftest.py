"""Shared fixtures of the docs tests: the CLI model (built once) and the repository root."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def model():
    from miles_cli.docs_cmd import cli_model

    return cli_model()


@pytest.fixture(scope="session")
def root() -> Path:
    return ROOT
