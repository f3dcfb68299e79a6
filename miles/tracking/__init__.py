"""Where a run's metrics go: `Tracker` fans `log(metrics, step)` out to JSONL, MLflow, TensorBoard, wandb, Prometheus.

- `miles.tracking.Tracker`: the sinks (tracker.py; one module per sink), chosen by `TrackingConfig`.
- `miles.tracking.metric_names`: the documented metric names the loop emits (part of the interface).
- `miles.tracking.plot.plot_curves`: reward / eval-accuracy curves from `metrics.jsonl` as a PNG.
- `miles.tracking.console`: rich progress bar and the one-line-per-step summary.

Importing this package is light (stdlib only); mlflow, torch (TensorBoard) and wandb are imported
when a Tracker enables their sink. This layer never decides what to log; the driver does.
"""

from miles.tracking.tracker import Tracker

__all__ = ["Tracker"]
