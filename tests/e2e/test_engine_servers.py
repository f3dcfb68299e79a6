"""The default recipe through the real CLI with 2 built-in engine servers behind sglang-router.

Slow: each test is one `miles full-train` of 200 rollouts (the default recipe's model, data, warm start
and settings, `--rollout-num-gpus 2`). Run them with

    python -m pytest -q -m slow tests/e2e/test_engine_servers.py -s

Why 200 rollouts and not the default's 500: the bar is the default's own (held-out greedy accuracy at
least 0.2 above the warm start, tests/e2e/test_full_train.py), and the default run meets it by step
200 already (0.27 -> 0.59 measured, in-process and with servers alike), so a shorter run keeps the bar
meaningful and the same and costs 2/5 of the time. The LR schedule is constant, so these 200 steps
are the first 200 of the default run.

Every request is seeded by (--rollout-seed, rollout id, sample index) and the engines give a seeded
request the same tokens whichever engine runs it and whatever else is in its batch. So a run whose
engine 0 is SIGKILLed mid-run with --use-fault-tolerance must end exactly where the undisturbed run
ends: the requests the dead engine had in flight are sent again and regenerate the same samples, and
the restarted engine serves only after it has the current weights, which the weight version of every
sample shows (`--save-debug-rollout-data`).
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
SERVERS = "--rollout-num-gpus 2 --num-rollout 200"
RUN_TIMEOUT_S = 2400  # a run is ~5 minutes on 2 idle cores; the machine that runs these may be loaded


def dirs(work: Path, run_id: str) -> list[str]:
    return ["--model-dir", str(work / "models"), "--data-dir", str(work / "data"), "--output-dir", str(work / "runs"), "--run-id", run_id]


def rows(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def evals(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["eval/arith/accuracy"] for r in rows(run_dir) if "eval/arith/accuracy" in r}


def rewards(run_dir: Path) -> list[float]:
    return [r["rollout/raw_reward"] for r in rows(run_dir) if "rollout/raw_reward" in r]


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("servers")


@pytest.fixture(scope="module")
def undisturbed(work) -> Path:
    args = ["full-train", *dirs(work, "two"), "--extra-args", SERVERS]
    r = subprocess.run(MILES + args, cwd=work, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return work / "runs" / "two"


@pytest.mark.slow
@pytest.mark.timeout(RUN_TIMEOUT_S + 600)
def test_two_engine_servers_behind_the_router_learn_like_the_default(undisturbed):
    acc = evals(undisturbed)
    assert sorted(acc) == [0, 50, 100, 150, 200]
    assert acc[200] >= acc[0] + 0.2, acc  # the default recipe's bar (tests/e2e/test_full_train.py)
    state = json.loads((undisturbed / "engines.json").read_text())
    assert [e["state"] for e in state["engines"]] == ["serving", "serving"] and state["restarts"] == 0
    logged = rows(undisturbed)
    assert {r["rollout/engine_restarts"] for r in logged if "rollout/engine_restarts" in r} == {0.0}
    assert {r["rollout/requeued_requests"] for r in logged if "rollout/requeued_requests" in r} == {0.0}


@pytest.mark.slow
@pytest.mark.timeout(RUN_TIMEOUT_S + 600)
def test_sigkill_of_an_engine_with_fault_tolerance_finishes_and_counts_the_restart(work, undisturbed):
    run_dir = work / "runs" / "killed"
    samples = run_dir / "rollout_data"
    extra = (f"{SERVERS} --use-fault-tolerance --rollout-health-check-interval 1 --rollout-health-check-timeout 10 "
             f"--save-debug-rollout-data {samples}/{{rollout_id}}.jsonl")  # fmt: skip
    proc = subprocess.Popen(MILES + ["full-train", *dirs(work, "killed"), "--extra-args", extra], cwd=work,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
    killed = None
    try:
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while proc.poll() is None and time.monotonic() < deadline:
            if killed is None and any(r.get("step", 0) >= 10 for r in rows(run_dir)):
                killed = json.loads((run_dir / "engines.json").read_text())["engines"][0]["pid"]
                os.kill(killed, signal.SIGKILL)
            time.sleep(0.2)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.terminate()  # miles stops cleanly on SIGTERM (its Ray, engines and router with it)
            proc.communicate(timeout=120)
    assert proc.returncode == 0, out[-4000:]
    assert killed is not None, "the run ended before step 10"
    assert f"pid {killed}" in out and "restarting it" in out, out[-4000:]
    restarts = [r["rollout/engine_restarts"] for r in rows(run_dir) if "rollout/engine_restarts" in r]
    assert restarts[0] == 0.0 and restarts[-1] == 1.0
    state = json.loads((run_dir / "engines.json").read_text())
    assert [e["state"] for e in state["engines"]] == ["serving", "serving"] and state["engines"][0]["pid"] != killed
    # Every sample of rollout r was generated with the weights of version r (the first sync is version
    # 0, the one after rollout r is r + 1): the restarted engine never answered with stale weights.
    versions = {int(p.stem): {json.loads(line)["weight_version"] for line in p.read_text().splitlines()} for p in samples.glob("*.jsonl")}
    assert sorted(versions) == list(range(200))
    assert all(v == {r} for r, v in versions.items()), {r: v for r, v in versions.items() if v != {r}}
    # Same samples, same training: the killed run ends exactly where the undisturbed one does.
    assert rewards(run_dir) == rewards(undisturbed)
    assert evals(run_dir) == evals(undisturbed)
