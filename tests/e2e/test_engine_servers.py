"""The default recipe through the real CLI with 2 built-in engine servers behind sglang-router.

Slow (each is a full `miles full-train`, minutes on 2 cores): the run learns as the in-process
default does, and a run whose engine 0 is SIGKILLed mid-run with --use-fault-tolerance finishes,
records the restart, and ends within noise of the undisturbed run (every request is seeded, so a
re-queued request regenerates the same sample on whichever engine takes it).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("sglang_router")

MILES = [sys.executable, "-m", "miles_cli.main"]
SERVERS = ["--extra-args", "--rollout-num-gpus 2"]


def dirs(work: Path, run_id: str) -> list[str]:
    return ["--model-dir", str(work / "models"), "--data-dir", str(work / "data"), "--output-dir", str(work / "runs"), "--run-id", run_id]


def rows(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def evals(run_dir: Path) -> list[float]:
    return [r["eval/arith/accuracy"] for r in rows(run_dir) if "eval/arith/accuracy" in r]


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("servers")


@pytest.fixture(scope="module")
def undisturbed(work) -> Path:
    r = subprocess.run(MILES + ["full-train", *dirs(work, "two"), *SERVERS], cwd=work, capture_output=True, text=True, timeout=2400)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return work / "runs" / "two"


@pytest.mark.slow
def test_two_engine_servers_behind_the_router_learn_like_the_default(undisturbed):
    acc = evals(undisturbed)
    assert acc[-1] >= acc[0] + 0.2, acc  # the default recipe's bar (tests/e2e/test_full_train.py)
    state = json.loads((undisturbed / "engines.json").read_text())
    assert len(state["engines"]) == 2 and state["restarts"] == 0


@pytest.mark.slow
def test_sigkill_of_an_engine_with_fault_tolerance_finishes_and_counts_the_restart(work, undisturbed):
    run_dir = work / "runs" / "killed"
    args = ["full-train", *dirs(work, "killed"), "--extra-args",
            "--rollout-num-gpus 2 --use-fault-tolerance --rollout-health-check-interval 1 --rollout-health-check-timeout 10"]  # fmt: skip
    proc = subprocess.Popen(MILES + args, cwd=work, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    killed = None
    deadline = time.monotonic() + 2400
    while proc.poll() is None and time.monotonic() < deadline:
        if killed is None and any(r.get("step", 0) >= 10 for r in rows(run_dir)):
            killed = json.loads((run_dir / "engines.json").read_text())["engines"][0]["pid"]
            os.kill(killed, signal.SIGKILL)
        time.sleep(0.2)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out[-4000:]
    assert killed is not None, "the run ended before step 10"
    restarts = [r["rollout/engine_restarts"] for r in rows(run_dir) if "rollout/engine_restarts" in r]
    assert restarts[0] == 0.0 and restarts[-1] >= 1.0
    assert f"pid {killed}" in out and "restarting it" in out
    a, b = evals(undisturbed), evals(run_dir)
    assert abs(a[-1] - b[-1]) <= 0.1, (a[-1], b[-1])
    assert b[-1] >= b[0] + 0.2
