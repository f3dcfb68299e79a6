"""MLflow sink against a real sqlite store: params and metric history read back with MlflowClient."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from miles.config.tracking import TrackingConfig
from miles.errors import UserError
from miles.tracking import Tracker
from miles.tracking.jsonl import read_metrics

PARAMS = {"rollout": {"rollout_batch_size": 8, "temperature": 1.0}, "seed": 42, "note": None, "long": "z" * 7000}


def _client(run_dir: Path) -> MlflowClient:
    return MlflowClient(tracking_uri=f"sqlite:///{run_dir.resolve() / 'mlflow.db'}")


def test_round_trip_params_and_metric_history(mlflow_run_dir: Path) -> None:
    cfg = TrackingConfig(use_mlflow=True, mlflow_experiment_name="exp-a")
    t = Tracker(cfg, run_dir=mlflow_run_dir, run_id="run-1", params=PARAMS)
    rewards = [0.125, 0.25, 0.5]
    for step, r in enumerate(rewards):
        t.log({"rollout/raw_reward": r, "eval/my@set/accuracy": 1 - r}, step=step)
    assert t.finish() == {}

    client = _client(mlflow_run_dir)
    run_id = (mlflow_run_dir / "mlflow_run_id.txt").read_text().strip()
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert run.info.run_name == "run-1"  # default run name = the miles run id
    assert client.get_experiment(run.info.experiment_id).name == "exp-a"
    params = run.data.params
    assert params["rollout.rollout_batch_size"] == "8"
    assert params["rollout.temperature"] == "1.0"
    assert params["seed"] == "42" and params["note"] == "None"
    assert len(params["long"]) == 6000
    history = client.get_metric_history(run_id, "rollout/raw_reward")
    assert sorted((m.step, m.value) for m in history) == [(0, 0.125), (1, 0.25), (2, 0.5)]
    sanitised = client.get_metric_history(run_id, "eval/my_set/accuracy")  # `@` is not allowed by MLflow
    assert sorted((m.step, m.value) for m in sanitised) == [(0, 0.875), (1, 0.75), (2, 0.5)]


def test_resume_continues_the_same_run_and_truncates_jsonl(mlflow_run_dir: Path) -> None:
    cfg = TrackingConfig(use_mlflow=True, mlflow_run_name="my-run")
    t = Tracker(cfg, run_dir=mlflow_run_dir, run_id="run-2", params=PARAMS)
    first_id = t.mlflow.run_id
    for step in range(4):
        t.log({"rollout/raw_reward": float(step)}, step=step)
    t.finish("FAILED")  # the process died after logging step 3; the checkpoint holds step 1

    changed = {**PARAMS, "seed": 7}
    t = Tracker(cfg, run_dir=mlflow_run_dir, run_id="run-2", params=changed, resume_step=2)
    assert t.mlflow.run_id == first_id
    client = _client(mlflow_run_dir)
    assert client.get_run(first_id).info.status == "RUNNING"
    assert [r["step"] for r in read_metrics(t.metrics_path)] == [0, 1]
    t.log({"rollout/raw_reward": 20.0}, step=2)
    t.finish()

    run = client.get_run(first_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "my-run"
    assert run.data.params["seed"] == "42"  # MLflow params are immutable ...
    assert run.data.tags["changed_param/seed"] == "7"  # ... so the new value is kept as a tag
    assert len(client.search_runs([run.info.experiment_id])) == 1
    steps = sorted((m.step, m.value) for m in client.get_metric_history(first_id, "rollout/raw_reward"))
    assert steps == [(0, 0.0), (1, 1.0), (2, 20.0)]  # the redone step once, with its new value (issue 28)
    assert run.data.metrics["rollout/raw_reward"] == 20.0  # the latest value is the redone one, not step 3's
    assert [(r["step"], r["rollout/raw_reward"]) for r in read_metrics(t.metrics_path)] == [(0, 0.0), (1, 1.0), (2, 20.0)]


def test_resume_on_a_store_that_cannot_delete_keeps_one_point_per_step(tmp_path: Path, monkeypatch, caplog) -> None:
    """MLflow's file store (like a tracking server) has no delete: a redone step is not sent again."""
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    cfg = TrackingConfig(use_mlflow=True, mlflow_tracking_uri=(tmp_path / "mlruns").as_uri())
    t = Tracker(cfg, run_dir=tmp_path / "run", run_id="r", params={}, strict=True)
    for step in range(4):
        t.log({"rollout/raw_reward": float(step), "train/loss": 1.0}, step=step)
    t.finish("KILLED")
    t = Tracker(cfg, run_dir=tmp_path / "run", run_id="r", params={}, resume_step=2, strict=True)
    assert "its store cannot delete points" in caplog.text
    for step in range(2, 5):
        t.log({"rollout/raw_reward": 10.0 * step, "train/loss": 2.0}, step=step)
    t.finish()
    client = MlflowClient(tracking_uri=cfg.mlflow_tracking_uri)
    history = sorted((m.step, m.value) for m in client.get_metric_history(t.mlflow.run_id, "rollout/raw_reward"))
    assert history == [(0, 0.0), (1, 1.0), (2, 2.0), (3, 3.0), (4, 40.0)]
    assert sorted(m.step for m in client.get_metric_history(t.mlflow.run_id, "train/loss")) == [0, 1, 2, 3, 4]


def test_explicit_run_id_resumes_that_run_and_unknown_id_is_a_user_error(
    mlflow_run_dir: Path, tmp_path: Path
) -> None:
    uri = f"sqlite:///{mlflow_run_dir.resolve() / 'mlflow.db'}"
    t = Tracker(TrackingConfig(use_mlflow=True), run_dir=mlflow_run_dir, run_id="a", params={})
    t.log({"x": 1.0}, step=0)
    t.finish()
    other_dir = tmp_path / "elsewhere"  # another output dir, same store, explicit --mlflow-run-id
    cfg = TrackingConfig(use_mlflow=True, mlflow_tracking_uri=uri, mlflow_run_id=t.mlflow.run_id)
    t2 = Tracker(cfg, run_dir=other_dir, run_id="b", params={}, resume_step=0, strict=True)
    assert t2.mlflow.run_id == t.mlflow.run_id
    assert (other_dir / "mlflow_run_id.txt").read_text().strip() == t.mlflow.run_id
    t2.log({"x": 2.0}, step=0)
    t2.log({"x": 3.0}, step=1)
    t2.finish()
    # Another directory's MLflow run: its points are never deleted, and step 0 is not logged twice.
    history = MlflowClient(tracking_uri=uri).get_metric_history(t.mlflow.run_id, "x")
    assert sorted((m.step, m.value) for m in history) == [(0, 1.0), (1, 3.0)]

    bad = dataclasses.replace(cfg, mlflow_run_id="0" * 32)
    with pytest.raises(UserError, match="--mlflow-run-id 0{32} is not a run") as info:
        Tracker(bad, run_dir=tmp_path / "third", run_id="c", params={})
    assert info.value.option == "--mlflow-run-id"


def test_stale_recorded_run_id_starts_a_new_run(mlflow_run_dir: Path) -> None:
    (mlflow_run_dir / "mlflow_run_id.txt").write_text("f" * 32 + "\n")  # a run of some other store
    t = Tracker(TrackingConfig(use_mlflow=True), run_dir=mlflow_run_dir, run_id="a", params={})
    t.finish()
    assert t.mlflow.run_id != "f" * 32
    assert (mlflow_run_dir / "mlflow_run_id.txt").read_text().strip() == t.mlflow.run_id


def test_keys_mapping_to_the_same_mlflow_name_keep_the_first(mlflow_run_dir: Path) -> None:
    t = Tracker(TrackingConfig(use_mlflow=True), run_dir=mlflow_run_dir, run_id="a", params={}, strict=True)
    t.log({"eval/a@b/acc": 1.0, "eval/a%b/acc": 2.0}, step=0)
    t.finish()
    history = _client(mlflow_run_dir).get_metric_history(t.mlflow.run_id, "eval/a_b/acc")
    assert [(m.step, m.value) for m in history] == [(0, 1.0)]
    assert read_metrics(t.metrics_path)[0]["eval/a%b/acc"] == 2.0  # the JSONL record keeps both


@pytest.mark.parametrize("derived_uri", [False, True], ids=["no-uri", "resolved-default-uri"])
def test_the_plot_is_an_artifact_of_the_mlflow_run_kept_in_the_run_directory(mlflow_run_dir: Path, tmp_path: Path, monkeypatch, derived_uri, run_store_config) -> None:
    monkeypatch.chdir(tmp_path)  # MLflow's own default would put artifacts in ./mlruns of the working directory
    cfg = run_store_config(mlflow_run_dir if derived_uri else None)
    t = Tracker(cfg, run_dir=mlflow_run_dir, run_id="run-art", params={})
    t.log({"rollout/raw_reward": 0.5}, step=1)
    plot = mlflow_run_dir / "curves.png"
    plot.write_bytes(b"\x89PNG not really")
    t.log_artifact(plot)
    assert t.finish() == {}
    client = _client(mlflow_run_dir)
    run_id = (mlflow_run_dir / "mlflow_run_id.txt").read_text().strip()
    assert [a.path for a in client.list_artifacts(run_id)] == ["curves.png"]
    stored = list((mlflow_run_dir / "mlflow_artifacts").rglob("curves.png"))
    assert len(stored) == 1 and stored[0].read_bytes() == plot.read_bytes()
    assert not (tmp_path / "mlruns").exists()


def test_only_the_run_directorys_own_sqlite_file_is_the_run_store(tmp_path: Path, run_store_config) -> None:
    from miles.tracking.mlflow_sink import is_run_store

    run = tmp_path / "run"
    assert is_run_store(None, run)
    assert is_run_store(run_store_config(run).mlflow_tracking_uri, run)  # the derived default
    assert is_run_store(f"sqlite:///{run.resolve()}/./mlflow.db", run)
    assert not is_run_store(f"sqlite:///{tmp_path / 'other' / 'mlflow.db'}", run)
    assert not is_run_store("http://127.0.0.1:5000", run)
    assert not is_run_store((run / "mlruns").as_uri(), run)

