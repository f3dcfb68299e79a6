"""Tracking options: MLflow, TensorBoard, wandb and Prometheus sinks for the run's metrics."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from miles.config.fields import option


@dataclass
class TrackingConfig:
    use_mlflow: bool = option(False, help="Log params and metrics to MLflow.")
    mlflow_tracking_uri: str | None = option(
        None,
        help="MLflow tracking URI; unset = a sqlite store in the run's output directory (no server needed).",
        env="MLFLOW_TRACKING_URI",
    )
    mlflow_experiment_name: str = option("miles", help="MLflow experiment name.")
    mlflow_run_name: str | None = option(None, help="MLflow run name; unset = the run id.")
    mlflow_run_id: str | None = option(None, help="Resume logging into this existing MLflow run.")
    use_tensorboard: bool = option(False, help="Write TensorBoard event files.")
    tensorboard_dir: str | None = option(
        None, help="TensorBoard log directory; unset = <output dir>/tensorboard.", env="TENSORBOARD_DIR"
    )
    use_wandb: bool = option(False, help="Log to Weights & Biases (needs `pip install miles[wandb]`).")
    wandb_mode: Literal["online", "offline", "disabled"] = option(
        "offline", help="wandb mode; offline writes runs locally for a later `wandb sync`."
    )
    wandb_project: str | None = option(None, help="wandb project; unset = miles.")
    wandb_group: str | None = option(None, help="wandb group; unset = the run id.")
    wandb_dir: str | None = option(None, help="wandb directory; unset = <output dir>/wandb.")
    use_prometheus: bool = option(False, help="Serve metrics as Prometheus gauges on --prometheus-port.")
    prometheus_host: str = option(
        "127.0.0.1",
        help="Address the Prometheus endpoint binds; 127.0.0.1 serves this machine only, 0.0.0.0 lets other hosts scrape it.",
    )
    prometheus_port: int = option(9090, help="Port of the Prometheus metrics endpoint.", env="PROMETHEUS_PORT")
    prometheus_run_name: str | None = option(None, help="Value of the run_name label on gauges; unset = the run id.")
