"""Fixtures for the torch backend tests (helpers in backend_fixtures.py)."""

from __future__ import annotations

import pytest
import torch
from backend_fixtures import make_tiny_hf_dir

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_hf_dir(tmp_path_factory) -> str:
    return make_tiny_hf_dir(tmp_path_factory.mktemp("tiny_qwen3"))


@pytest.fixture(scope="session")
def tiny_tied_hf_dir(tmp_path_factory) -> str:
    return make_tiny_hf_dir(tmp_path_factory.mktemp("tiny_qwen3_tied"), seed=1, tie_word_embeddings=True)
