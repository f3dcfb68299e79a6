"""MLflow's writes on a thread (miles/tracking/background.py): log returns at once, close writes everything."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from miles.config.tracking import TrackingConfig
from miles.tracking import Tracker
from miles.tracking.background import BackgroundSink


class SlowSink:
    name = "slow"

    def __init__(self, fail_steps=()):
        self.calls: list[list[tuple[dict, int]]] = []
        self.closed = None
        self.fail_steps = set(fail_steps)
        self.gate = threading.Event()

    def log_many(self, records):
        self.gate.wait(5)
        if any(step in self.fail_steps for _, step in records):
            raise RuntimeError("store went away")
        self.calls.append(list(records))

    def log(self, metrics, step):
        if step in self.fail_steps:
            raise RuntimeError("store went away")
        self.calls.append([(dict(metrics), step)])

    def close(self, status):
        self.closed = status


def test_log_does_not_wait_for_the_store_and_close_writes_everything_in_order():
    inner, errors = SlowSink(), []
    sink = BackgroundSink(inner, on_error=lambda s, step: errors.append(step))
    t0 = time.perf_counter()
    for step in range(5):
        sink.log({"x": float(step)}, step)
    assert time.perf_counter() - t0 < 1.0 and inner.calls == []  # the store is blocked; log was not
    inner.gate.set()
    sink.close("FINISHED")
    written = [(m["x"], step) for call in inner.calls for m, step in call]
    assert written == [(float(s), s) for s in range(5)] and inner.closed == "FINISHED" and errors == []
    assert len(inner.calls) < 5  # what queued up while the store was busy went in one write


def test_a_failing_write_is_reported_and_the_others_still_land():
    inner, errors = SlowSink(fail_steps={2}), []
    inner.gate.set()
    sink = BackgroundSink(inner, on_error=lambda s, step: errors.append(step))
    for step in range(4):
        sink.log({"x": float(step)}, step)
    sink.close("FAILED")
    assert errors == [2] and sorted(step for call in inner.calls for _, step in call) == [0, 1, 3]


def test_the_tracker_writes_mlflow_in_the_background_and_finish_leaves_every_step(tmp_path: Path):
    from mlflow.tracking import MlflowClient

    t = Tracker(TrackingConfig(use_mlflow=True), run_dir=tmp_path, run_id="bg", params={})
    assert isinstance(t.mlflow, BackgroundSink)
    for step in range(20):
        t.log({"rollout/raw_reward": step / 10}, step=step)
    t.finish()
    history = MlflowClient(t.mlflow.tracking_uri).get_metric_history(t.mlflow.run_id, "rollout/raw_reward")
    assert sorted((m.step, m.value) for m in history) == [(s, s / 10) for s in range(20)]
    assert MlflowClient(t.mlflow.tracking_uri).get_run(t.mlflow.run_id).info.status == "FINISHED"


@pytest.mark.parametrize("derived_uri", [False, True], ids=["no-uri", "resolved-default-uri"])
def test_the_tracker_opens_mlflow_on_its_thread_without_waiting_and_loses_nothing(tmp_path: Path, monkeypatch, derived_uri, run_store_config):
    """MLflow's imports, store, run and params are seconds of CPU; the driver's Tracker must not wait
    for them before the first step. The open is held here: the Tracker is built and logs meanwhile."""
    from mlflow.tracking import MlflowClient

    from miles.tracking import mlflow_sink

    gate, opened_on = threading.Event(), []
    real_init = mlflow_sink.MlflowSink.__init__

    def held_init(self, *args, **kwargs):
        opened_on.append(threading.current_thread().name)
        gate.wait(30)
        real_init(self, *args, **kwargs)

    monkeypatch.setattr(mlflow_sink.MlflowSink, "__init__", held_init)
    t0 = time.perf_counter()
    params = {"seed": 7, "data": {"rollout_batch_size": 32}}
    t = Tracker(run_store_config(tmp_path if derived_uri else None), run_dir=tmp_path, run_id="held", params=params)
    for step in range(3):
        t.log({"rollout/raw_reward": step / 10}, step=step)
    assert time.perf_counter() - t0 < 5 and not gate.is_set()  # built and logged while the open waits
    params["seed"] = 8  # the caller's config after the Tracker was built: the run records the value it had
    gate.set()
    t.finish()
    assert opened_on and opened_on[0] != threading.main_thread().name
    client = MlflowClient(t.mlflow.tracking_uri)
    run = client.get_run(t.mlflow.run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params["seed"] == "7" and run.data.params["data.rollout_batch_size"] == "32"
    history = client.get_metric_history(t.mlflow.run_id, "rollout/raw_reward")
    assert sorted((m.step, m.value) for m in history) == [(s, s / 10) for s in range(3)]


def test_an_mlflow_sink_that_cannot_open_on_its_thread_ends_the_run_with_its_own_error(tmp_path: Path, monkeypatch):
    from miles.errors import UserError
    from miles.tracking import mlflow_sink

    def cannot_open(self, *args, **kwargs):
        raise UserError("the MLflow store cannot be opened here.", option="--use-mlflow")

    monkeypatch.setattr(mlflow_sink.MlflowSink, "__init__", cannot_open)
    t = Tracker(TrackingConfig(use_mlflow=True), run_dir=tmp_path / "a", run_id="a", params={})  # returns: the open is on the thread
    assert isinstance(t.mlflow.open_error, UserError)  # waits for the open
    with pytest.raises(UserError, match="cannot be opened"):  # the next log: not counted as a failed write
        t.log({"x": 1.0}, step=1)
    assert t.sink_errors == {}
    t.finish("FAILED")  # the run already stopped with it: reported, not raised again
    quiet = Tracker(TrackingConfig(use_mlflow=True), run_dir=tmp_path / "b", run_id="b", params={})
    with pytest.raises(UserError, match="cannot be opened"):  # a run that logged nothing after it still ends with it
        quiet.finish("FINISHED")
