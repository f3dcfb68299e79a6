"""Tracking options: MLflow, TensorBoard, wandb and Prometheus sinks for the run's metrics.

Names and places a sink would otherwise choose in code (the run name, the sqlite store, the
TensorBoard directory) are derived defaults declared here, computed from the run's identity
(`EngineConfig.run`: run id and run directory), so help and the options table show the real value.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from miles.config.fields import Derived, option


def _in_run_dir(name: str):
    return lambda c: None if c.run.run_dir is None else str(Path(c.run.run_dir) / name)


def _mlflow_store(c) -> str | None:
    # Relative like the run directory itself (sqlite reads it against the driver's working directory).
    return None if c.run.run_dir is None else f"sqlite:///{Path(c.run.run_dir) / 'mlflow.db'}"


_RUN_ID = Derived("the run id (--run-id)", lambda c: c.run.run_id)


@dataclass
class TrackingConfig:
    use_mlflow: bool = option(False, help="Log params and metrics to MLflow.")
    mlflow_tracking_uri: str | None = option(
        help="MLflow tracking URI (a server, or a local store: no server needed).",
        env="MLFLOW_TRACKING_URI",
        derived=Derived("a sqlite store in the run directory, sqlite:///<run dir>/mlflow.db", _mlflow_store),
    )
    mlflow_experiment_name: str = option("miles", help="MLflow experiment name.")
    mlflow_run_name: str | None = option(help="MLflow run name.", derived=_RUN_ID)
    mlflow_run_id: str | None = option(None, help="Resume logging into this existing MLflow run.")
    use_tensorboard: bool = option(False, help="Write TensorBoard event files.")
    tensorboard_dir: str | None = option(
        help="TensorBoard log directory.",
        env="TENSORBOARD_DIR",
        derived=Derived("<run dir>/tensorboard", _in_run_dir("tensorboard")),
    )
    use_wandb: bool = option(False, help="Log to Weights & Biases (needs `pip install miles[wandb]`).")
    wandb_mode: Literal["online", "offline", "disabled"] = option(
        "offline", help="wandb mode; offline writes runs locally for a later `wandb sync`."
    )
    wandb_project: str = option("miles", help="wandb project.")
    wandb_group: str | None = option(help="wandb group.", derived=_RUN_ID)
    wandb_dir: str | None = option(help="wandb directory.", derived=Derived("<run dir>/wandb", _in_run_dir("wandb")))
    use_prometheus: bool = option(False, help="Serve metrics as Prometheus gauges on --prometheus-port.")
    prometheus_host: str = option(
        "127.0.0.1",
        help="Address the Prometheus endpoint binds; 127.0.0.1 serves this machine only, 0.0.0.0 lets other hosts scrape it.",
    )
    prometheus_port: int = option(9090, help="Port of the Prometheus metrics endpoint.", env="PROMETHEUS_PORT")
    prometheus_run_name: str | None = option(help="Value of the run_name label on gauges.", derived=_RUN_ID)
