"""Tracker fan-out and failure policy: every sink gets every call; one failing sink never stops the others."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path

import pytest

from miles.config.tracking import TrackingConfig
from miles.tracking import Tracker
from miles.tracking.jsonl import read_metrics


class _Recorder:
    def __init__(self, name: str, *, fail_log: bool = False, fail_close: bool = False) -> None:
        self.name, self.fail_log, self.fail_close = name, fail_log, fail_close
        self.logged: list[tuple[dict, int]] = []
        self.closed: list[str] = []

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        if self.fail_log:
            raise ConnectionError("server went away")
        self.logged.append((dict(metrics), step))

    def close(self, status: str) -> None:
        self.closed.append(status)
        if self.fail_close:
            raise OSError("disk full")


def _tracker(run_dir: Path, *sinks: _Recorder, strict: bool = False) -> Tracker:
    t = Tracker(TrackingConfig(), run_dir=run_dir, run_id="r", params={}, strict=strict)
    t.sinks.extend(sinks)
    return t


def test_failing_sink_is_counted_and_the_others_still_log(run_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    bad, good = _Recorder("bad", fail_log=True), _Recorder("good")
    t = _tracker(run_dir, bad, good)
    with caplog.at_level(logging.WARNING, logger="miles.tracking.tracker"):
        t.log({"a": 1}, step=0)
        t.log({"a": 2}, step=1)
    assert good.logged == [({"a": 1.0}, 0), ({"a": 2.0}, 1)]
    assert t.sink_errors == {"bad": 2}
    assert sum("metrics sink bad failed" in r.message for r in caplog.records) == 1  # traceback once, then counted
    assert [r["a"] for r in read_metrics(t.metrics_path)] == [1.0, 2.0]
    with caplog.at_level(logging.WARNING, logger="miles.tracking.tracker"):
        t.finish()
    assert "metrics sink bad failed 2 time(s)" in caplog.text


def test_strict_mode_propagates_sink_errors(run_dir: Path) -> None:
    t = _tracker(run_dir, _Recorder("bad", fail_log=True), strict=True)
    with pytest.raises(ConnectionError):
        t.log({"a": 1}, step=0)
    t.finish()


def test_one_sink_failing_to_close_does_not_stop_the_others(run_dir: Path) -> None:
    first, broken, last = _Recorder("first"), _Recorder("broken", fail_close=True), _Recorder("last")
    t = _tracker(run_dir, first, broken, last)
    errors = t.finish("KILLED")
    assert list(errors) == ["broken"] and isinstance(errors["broken"], OSError)
    assert first.closed == broken.closed == last.closed == ["KILLED"]
    assert t.jsonl._file is None  # the JSONL file was closed too
    assert t.finish() == {}  # idempotent: nothing is closed twice
    assert first.closed == ["KILLED"]
    with pytest.raises(RuntimeError, match="after finish"):
        t.log({"a": 1}, step=0)


def test_context_manager_maps_exit_to_status(run_dir: Path) -> None:
    sinks = {name: _Recorder(name) for name in ("ok", "err", "kill")}
    with _tracker(run_dir / "1", sinks["ok"]):
        pass
    with pytest.raises(ZeroDivisionError), _tracker(run_dir / "2", sinks["err"]):
        1 / 0
    with pytest.raises(KeyboardInterrupt), _tracker(run_dir / "3", sinks["kill"]):
        raise KeyboardInterrupt
    assert [s.closed for s in sinks.values()] == [["FINISHED"], ["FAILED"], ["KILLED"]]


def test_bad_status_and_empty_log(run_dir: Path) -> None:
    rec = _Recorder("rec")
    t = _tracker(run_dir, rec)
    t.log({}, step=0)  # nothing to record: no empty JSONL line, no sink call
    assert rec.logged == [] and t.metrics_path.read_text() == ""
    with pytest.raises(ValueError, match="status must be one of"):
        t.finish("DONE")  # type: ignore[arg-type]
    t.finish()


def test_all_sinks_at_once_get_the_same_numbers(mlflow_run_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import sys
    import types
    import urllib.request

    from mlflow.tracking import MlflowClient

    wandb_logged: list = []
    fake = types.ModuleType("wandb")
    fake.init = lambda **kw: types.SimpleNamespace(  # type: ignore[attr-defined]
        log=lambda data, step: wandb_logged.append((data, step)), finish=lambda exit_code: None
    )
    monkeypatch.setitem(sys.modules, "wandb", fake)
    cfg = TrackingConfig(use_mlflow=True, use_tensorboard=True, use_wandb=True, use_prometheus=True, prometheus_port=0)
    kw = {"run_id": "all", "params": {"seed": 1}, "strict": True}
    with Tracker(cfg, run_dir=mlflow_run_dir, **kw) as t:
        t.log({"rollout/raw_reward": 0.625}, step=4)
        page = urllib.request.urlopen(f"http://127.0.0.1:{t.prometheus.port}/metrics", timeout=5).read().decode()
    assert 'miles_metric_rollout_raw_reward{run_name="all"} 0.625' in page
    assert wandb_logged == [({"rollout/raw_reward": 0.625}, 4)]
    history = MlflowClient(t.mlflow.tracking_uri).get_metric_history(t.mlflow.run_id, "rollout/raw_reward")
    assert [(m.step, m.value) for m in history] == [(4, 0.625)]
    assert [(r["step"], r["rollout/raw_reward"]) for r in read_metrics(t.metrics_path)] == [(4, 0.625)]
    assert list((mlflow_run_dir / "tensorboard").glob("events.out.tfevents.*"))


