"""Shared fixtures for the tracking tests: one initialised MLflow sqlite store per session.

Creating a sqlite store runs MLflow's schema migrations (2-8 s on a busy 2-core machine), so the
session builds one empty store and each test copies the file; copying it to `<run_dir>/mlflow.db`
also exercises the Tracker's default store path.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest
import torch

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def empty_mlflow_db(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from mlflow.tracking import MlflowClient

    logging.getLogger("mlflow").setLevel(logging.WARNING)
    path = tmp_path_factory.mktemp("mlflow-template") / "mlflow.db"
    MlflowClient(tracking_uri=f"sqlite:///{path}").search_experiments()  # runs the migrations
    return path


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    return tmp_path / "run"


@pytest.fixture
def mlflow_run_dir(run_dir: Path, empty_mlflow_db: Path) -> Path:
    """A run directory that already holds an empty, migrated `mlflow.db` (the Tracker's default store)."""
    run_dir.mkdir()
    shutil.copy(empty_mlflow_db, run_dir / "mlflow.db")
    return run_dir


def _run_store_config(run_dir: Path | None):
    """MLflow on, its store as a run resolves it: no URI (a Tracker built by hand), or the option's own
    derived default for `run_dir` (every real run: a resolved config always names a store)."""
    from types import SimpleNamespace

    from miles.config.tracking import TrackingConfig, _mlflow_store

    uri = None if run_dir is None else _mlflow_store(SimpleNamespace(run=SimpleNamespace(run_dir=str(run_dir))))
    return TrackingConfig(use_mlflow=True, mlflow_tracking_uri=uri)


@pytest.fixture
def run_store_config():
    return _run_store_config

