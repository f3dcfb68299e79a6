"""`Tracker`: one `log(metrics, step)` that fans out to every enabled sink, and `finish(status)`.

Sinks (docs/monitoring.md has the user-facing story):

| sink | enabled by | writes to |
|---|---|---|
| JSONL (`jsonl`) | always | `<run_dir>/metrics.jsonl` |
| MLflow (`mlflow_sink`) | `--use-mlflow` | `--mlflow-tracking-uri`, else `sqlite:///<run_dir>/mlflow.db` |
| TensorBoard (`tensorboard_sink`) | `--use-tensorboard` | `--tensorboard-dir`, else `<run_dir>/tensorboard` |
| wandb (`wandb_sink`) | `--use-wandb` | `--wandb-dir`, else `<run_dir>/wandb` (offline by default) |
| Prometheus (`prometheus_sink`) | `--use-prometheus` | HTTP `<--prometheus-host>:<--prometheus-port>/metrics` |

Usage (the driver, once, in the driver process):

    with Tracker(cfg.tracking, run_dir=out, run_id=run_id, params=cfg, resume_step=first_redone_step) as t:
        for step in range(start, num_rollout):
            t.log({"rollout/raw_reward": r, ...}, step=step)   # several calls per step are fine

Leaving the `with` block normally finishes the sinks as FINISHED, by KeyboardInterrupt as KILLED,
by any other exception as FAILED. Without `with`, call `finish(status)` yourself.

Failure policy: the JSONL file is the record of the run, so an error writing it propagates. An error
in another sink's `log` (an MLflow server that went away) is logged with its traceback the first
time, counted in `sink_errors`, and the run goes on (`strict=True` makes it propagate, for tests).
MLflow's writes run on a thread of their own (`miles.tracking.background`; not with `strict=True`):
`log` returns at once and `finish` waits until the store has every record. With the default store
(the run's own sqlite file, no `--mlflow-run-id`) the sink is also opened on that thread (MLflow's
imports, the store, the run and its params: seconds of CPU the driver no longer spends before the
first step); an error while opening it is raised by the next `log` (or by `finish`). A store or run
the user named is opened in the constructor, so a wrong one stops the run before it trains.
`finish` closes every sink even when one fails to close, then reports the failures with a warning
and returns them. This module decides nothing about *what* is logged: see metric_names.py.
"""

from __future__ import annotations

import logging
import numbers
import threading
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import Any, Literal, Protocol

from miles.config.tracking import TrackingConfig
from miles.tracking.jsonl import JsonlSink

log = logging.getLogger(__name__)

Status = Literal["FINISHED", "FAILED", "KILLED"]
STATUSES = ("FINISHED", "FAILED", "KILLED")
RESERVED_KEYS = ("step", "time")  # the JSONL record's own fields


class Sink(Protocol):
    name: str

    def log(self, metrics: Mapping[str, float], step: int) -> None: ...

    def close(self, status: str) -> None: ...


def _as_float(key: Any, value: Any) -> float:
    if not isinstance(key, str):
        raise TypeError(f"metric keys must be str, got {key!r}")
    if key in RESERVED_KEYS:
        raise ValueError(f"metric key {key!r} is reserved for the JSONL record; rename the metric")
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, numbers.Real):
        return float(value)
    try:
        return float(value)  # 0-d torch/numpy values
    except (TypeError, ValueError):
        raise TypeError(f"metric {key!r} must be a number, got {type(value).__name__}: {value!r}") from None


class Tracker:
    """Opens every sink `cfg` enables (see the module docstring).

    - `run_dir`: the run's output directory (created if missing); default home of every sink's files.
    - `run_id`: the miles run id: default MLflow run name, wandb group and id, Prometheus run_name.
    - `params`: the configuration to record once (MLflow params, wandb config): a dict (nested dicts
      become `a.b` keys) or the `EngineConfig` itself, which gives `group.option` keys and masks
      options declared `secret=True`.
    - `resume_step`: on resume, the first step that will be logged again; records at steps >= it are
      dropped from metrics.jsonl and MLflow (mlflow_sink.py says how) and hidden in TensorBoard.
      None for a fresh run.
    - `strict`: let a failing sink's `log` error propagate instead of counting it.
    """

    def __init__(
        self,
        cfg: TrackingConfig,
        *,
        run_dir: str | Path,
        run_id: str,
        params: Mapping[str, Any] | Any,
        resume_step: int | None = None,
        strict: bool = False,
    ):
        self.run_dir = Path(run_dir)
        self.run_id = run_id
        self.strict = strict
        self.sink_errors: dict[str, int] = {}
        self._errors_lock = threading.Lock()
        self._finished = False
        self.jsonl = JsonlSink(self.run_dir, resume_step=resume_step)
        self.sinks: list[Sink] = [self.jsonl]
        self.mlflow = self.tensorboard = self.wandb = self.prometheus = None
        try:
            if cfg.use_mlflow:
                from miles.tracking.mlflow_sink import MlflowSink, is_run_store

                from miles.tracking.background import BackgroundSink

                if strict:  # opened here, and its errors raise in log()
                    self.mlflow = MlflowSink(cfg, run_dir=self.run_dir, run_id=run_id, params=params, resume_step=resume_step)
                elif cfg.mlflow_run_id or not is_run_store(cfg.mlflow_tracking_uri, self.run_dir):
                    # A store or run the user named: checked here, so a wrong one stops the run before it trains.
                    self.mlflow = BackgroundSink(
                        MlflowSink(cfg, run_dir=self.run_dir, run_id=run_id, params=params, resume_step=resume_step),
                        on_error=self._sink_failed)
                else:  # the run's own sqlite file: opened and written on a thread (imports, store, run, params)
                    from miles.tracking.keys import flatten_params

                    flat = flatten_params(params)  # here: the thread never reads a config the driver holds

                    def open_mlflow() -> MlflowSink:
                        return MlflowSink(cfg, run_dir=self.run_dir, run_id=run_id, params=flat, resume_step=resume_step)

                    self.mlflow = BackgroundSink.opening("mlflow", open_mlflow, on_error=self._sink_failed)
                self.sinks.append(self.mlflow)
            if cfg.use_tensorboard:
                from miles.tracking.tensorboard_sink import TensorBoardSink

                self.tensorboard = TensorBoardSink(cfg, run_dir=self.run_dir, resume_step=resume_step)
                self.sinks.append(self.tensorboard)
            if cfg.use_wandb and cfg.wandb_mode != "disabled":
                from miles.tracking.wandb_sink import WandbSink

                self.wandb = WandbSink(cfg, run_dir=self.run_dir, run_id=run_id, params=params)
                self.sinks.append(self.wandb)
            if cfg.use_prometheus:
                from miles.tracking.prometheus_sink import PrometheusSink

                self.prometheus = PrometheusSink(cfg, run_id=run_id)
                self.sinks.append(self.prometheus)
        except BaseException:
            self.finish("FAILED")  # close what was opened (files, a bound port) before re-raising
            raise

    @property
    def metrics_path(self) -> Path:
        return self.jsonl.path

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        """Record `metrics` (flat `/`-separated names → numbers) at `step` (the rollout id) in every sink."""
        if self._finished:
            raise RuntimeError("Tracker.log() after finish()")
        if isinstance(step, bool) or not isinstance(step, numbers.Integral) or step < 0:
            raise TypeError(f"step must be a non-negative int, got {step!r}")
        step = int(step)
        values = {k: _as_float(k, v) for k, v in metrics.items()}
        if not values:
            return
        self.jsonl.log(values, step)
        for sink in self.sinks[1:]:
            check = getattr(sink, "raise_if_open_failed", None)
            if check is not None:
                check()  # a sink opened in the background that could not open ends the run, as opening here would
            try:
                sink.log(values, step)
            except Exception:
                if self.strict:
                    raise
                self._sink_failed(sink, step)

    def _sink_failed(self, sink: Sink, step: int) -> None:
        """Count a failed write (called inside the `except`, from `log` or a background writer)."""
        with self._errors_lock:
            count = self.sink_errors.get(sink.name, 0) + 1
            self.sink_errors[sink.name] = count
        if count == 1:
            log.exception(
                "metrics sink %s failed at step %d; the run continues, later failures are counted",
                sink.name, step,
            )

    def log_artifact(self, path: str | Path) -> None:
        """Attach a file (the run's plot) in every sink that keeps files (MLflow); a failure is counted
        like a failed `log` (raised with `strict=True`)."""
        if self._finished:
            raise RuntimeError("Tracker.log_artifact() after finish()")
        for sink in self.sinks[1:]:
            attach = getattr(getattr(sink, "sink", sink), "log_artifact", None)  # through a BackgroundSink
            if attach is None:
                continue
            try:
                if hasattr(sink, "flush"):
                    sink.flush()  # the writer thread is idle while this thread uses the client
                attach(Path(path))
            except Exception:
                if self.strict:
                    raise
                self._sink_failed(sink, -1)

    def finish(self, status: Status = "FINISHED") -> dict[str, BaseException]:
        """Close every sink (each one even if another fails); returns {sink name: error} for those that failed."""
        if status not in STATUSES:
            raise ValueError(f"status must be one of {STATUSES}, got {status!r}")
        if self._finished:
            return {}
        self._finished = True
        errors: dict[str, BaseException] = {}
        for sink in reversed(self.sinks):  # the JSONL file last: it is the record of the other sinks' fate
            try:
                sink.close(status)
            except Exception as e:
                errors[sink.name] = e
                log.warning("closing metrics sink %s failed: %s: %s", sink.name, type(e).__name__, e, exc_info=e)
        for name, count in self.sink_errors.items():
            log.warning("metrics sink %s failed %d time(s) during the run; its record is incomplete", name, count)
        for sink in self.sinks:
            failed = getattr(sink, "open_error", None)  # a background sink that never opened (a bad --mlflow-run-id)
            if failed is None:
                continue
            if status == "FINISHED":
                raise failed  # a run that otherwise went well still ends with the sink's own error
            errors[sink.name] = failed
            log.warning("metrics sink %s never opened: %s: %s", sink.name, type(failed).__name__, failed)
        return errors

    def __enter__(self) -> Tracker:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc_type is None:
            self.finish("FINISHED")
        elif issubclass(exc_type, KeyboardInterrupt):
            self.finish("KILLED")
        else:
            self.finish("FAILED")


__all__ = ["STATUSES", "Status", "Tracker"]
