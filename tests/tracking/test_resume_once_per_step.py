"""A run killed mid-way and resumed holds each step once in every record (issue 28, item 4).

Through the `miles` program: the tiny recipe's debug run, with MLflow and TensorBoard on, is
SIGKILLed once a step after its first checkpoint is logged, then the same command resumes it and
redoes that step. Afterwards metrics.jsonl has one line per step, MLflow one point per step for
every metric (the interrupted run once left 506 points for 500 steps), and TensorBoard, read the
way TensorBoard reads it (purging the killed attempt's redone steps), one value per step per tag.

Run: pytest -m slow tests/tracking/test_resume_once_per_step.py
"""

from __future__ import annotations

import collections
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MILES = [sys.executable, "-m", "miles_cli.main"]


@pytest.mark.slow
def test_killed_and_resumed_run_logs_every_step_once(tmp_path):
    run_dir = tmp_path / "runs" / "killed"
    args = ["full-train", "--mode", "debug_minimal", "--num-rollout", "6", "--save-interval", "2",
            "--use-mlflow", "--use-tensorboard", "--model-dir", str(tmp_path / "models"), "--data-dir", str(tmp_path / "data"),
            "--output-dir", str(tmp_path / "runs"), "--run-id", "killed"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.Popen(MILES + args, cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    metrics = run_dir / "metrics.jsonl"

    def logged() -> set[int]:
        text = metrics.read_text() if metrics.exists() else ""
        return {json.loads(line)["step"] for line in text.splitlines() if line.endswith("}")}

    try:
        deadline = time.monotonic() + 900
        # Rollout r is step r + 1; the first checkpoint (rollout 1) is step 2: step 3 is logged and not saved.
        while 3 not in logged():
            assert proc.poll() is None, "the run ended before step 3"
            assert time.monotonic() < deadline, "no step 3 after 900 s"
            time.sleep(0.05)
        assert proc.poll() is None and 6 not in logged(), "the run finished before it could be killed"
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
    r = subprocess.run(MILES + args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "Resumed from rollout 1" in r.stdout, r.stdout[-3000:]

    lines = [json.loads(line) for line in metrics.read_text().splitlines()]
    steps = [row["step"] for row in lines]
    assert steps == sorted(set(steps)) and steps[-1] == 6, steps  # one line per step, in order
    expected = collections.Counter(k for row in lines for k in row if k not in ("step", "time"))

    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{run_dir / 'mlflow.db'}")
    mlflow_id = (run_dir / "mlflow_run_id.txt").read_text().strip()
    keys = client.get_run(mlflow_id).data.metrics
    assert "rollout/raw_reward" in keys
    for key in keys:
        history = client.get_metric_history(mlflow_id, key)
        assert len(history) == len({m.step for m in history}), f"{key}: {sorted(m.step for m in history)}"
    for key in ("rollout/raw_reward", "train/grad_norm"):
        assert len(client.get_metric_history(mlflow_id, key)) == expected[key], key

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    for tag in acc.Tags()["scalars"]:
        events = acc.Scalars(tag)
        assert len(events) == len({e.step for e in events}), f"{tag}: {sorted(e.step for e in events)}"
    assert len(acc.Scalars("rollout/raw_reward")) == expected["rollout/raw_reward"]
