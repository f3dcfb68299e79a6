"""The tool-calling recipe through the real CLI (slow): `miles full-train --model-name tiny-qwen3-tools`.

    python -m pytest -q -m slow tests/e2e/test_tools_recipe.py -s

1. In process, the whole recipe (prepare, SFT on tool conversations, multi-turn GRPO with the calculator)
   within 15 minutes (checked when the 2 cores are idle, load average < 3): held-out greedy accuracy at least 0.2 above the warm start (step-0 eval) and the
   tool-call rate up, in eval and in the rollouts.
2. The same multi-turn rollouts through 2 built-in engine servers behind sglang-router
   (`--rollout-num-gpus 2`, 20 rollouts): it learns too, and its rollouts are exactly the in-process
   run's first 20 (seeded turns give the same tokens on any engine).
3. Engine death mid-run with `--use-fault-tolerance`: engine 0 is SIGKILLed; a multi-turn trajectory whose
   turn was in flight on it resumes from its last complete turn (the turn's request, same ids and seed,
   goes to the live engine), so the run ends exactly where the undisturbed server run ends: same
   rewards, same eval, same tool-call rates.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

MILES = [sys.executable, "-m", "miles_cli.main"]
RECIPE = ["--model-name", "tiny-qwen3-tools"]
BUDGET_S = 900  # the bar: <= 15 minutes on 2 CPU cores
RUN_TIMEOUT_S = 2400  # what a run may take on a loaded machine; the bar is checked only on an idle one
IDLE_LOAD = 3.0  # load average (1 min) below which 2 cores are the run's own
SERVERS = "--rollout-num-gpus 2 --num-rollout 20 --eval-interval 10"
SERVER_TIMEOUT_S = 1800


def dirs(work: Path, run_id: str) -> list[str]:
    return ["--model-dir", str(work / "models"), "--data-dir", str(work / "data"), "--output-dir", str(work / "runs"), "--run-id", run_id]


def rows(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def series(run_dir: Path, key: str) -> dict[int, float]:
    return {r["step"]: r[key] for r in rows(run_dir) if key in r}


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("tools")


@pytest.fixture(scope="module")
def in_process(work) -> tuple[Path, float, str]:
    load_before = os.getloadavg()[0]
    t0 = time.monotonic()
    r = subprocess.run(MILES + ["full-train", *RECIPE, *dirs(work, "inproc")], cwd=work, capture_output=True, text=True,
                       timeout=RUN_TIMEOUT_S)  # fmt: skip
    elapsed = time.monotonic() - t0
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    load = max(load_before, os.getloadavg()[0])
    print(f"\ntiny-qwen3-tools full-train: {elapsed:.0f} s; load average {load_before:.1f} before, {os.getloadavg()} after")
    return work / "runs" / "inproc", elapsed if load < IDLE_LOAD else None, r.stdout


@pytest.mark.slow
@pytest.mark.timeout(RUN_TIMEOUT_S + 300)
def test_the_recipe_learns_to_call_the_calculator_within_15_minutes(in_process):
    run_dir, elapsed, out = in_process
    acc = series(run_dir, "eval/tools/reward")
    calls = series(run_dir, "eval/tools/tool_call_rate")
    print({"eval reward": acc, "eval tool_call_rate": calls})
    assert sorted(acc) == [0, 10, 20, 30]
    assert acc[30] >= acc[0] + 0.2, acc  # the bar, held out and greedy
    assert calls[30] > calls[0], calls
    rollout_calls = list(series(run_dir, "rollout/tool_call_rate").values())
    assert sum(rollout_calls[-5:]) / 5 > sum(rollout_calls[:5]) / 5, rollout_calls
    assert "before training" in out
    # The time bar holds on 2 idle cores; on a shared machine the wall time says how busy it was, not
    # how long the recipe takes (measured and recorded in docs/benchmarks.md with the load).
    assert elapsed is None or elapsed <= BUDGET_S, elapsed


@pytest.fixture(scope="module")
def two_servers(work, in_process) -> Path:  # after the in-process run: its prepared model and data are reused
    args = ["full-train", *RECIPE, *dirs(work, "two"), "--extra-args", SERVERS]
    r = subprocess.run(MILES + args, cwd=work, capture_output=True, text=True, timeout=SERVER_TIMEOUT_S)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return work / "runs" / "two"


@pytest.mark.slow
@pytest.mark.timeout(RUN_TIMEOUT_S + SERVER_TIMEOUT_S + 300)
def test_the_multi_turn_rollout_runs_through_two_engine_servers_behind_the_router(two_servers, in_process):
    pytest.importorskip("sglang_router")
    acc = series(two_servers, "eval/tools/reward")
    assert sorted(acc) == [0, 10, 20] and acc[20] >= acc[0] + 0.2, acc
    assert min(series(two_servers, "rollout/num_turns").values()) > 1.0  # every rollout ran tool turns
    # Seeded turns give the same tokens on any engine, so the servers' 20 rollouts are the in-process
    # run's first 20 (measured: equal in every reward, tool-call rate and turn count).
    for key in ("rollout/raw_reward", "rollout/tool_call_rate", "rollout/num_turns"):
        alone = {step: v for step, v in series(in_process[0], key).items() if step <= 20}
        assert series(two_servers, key) == alone, key
    state = json.loads((two_servers / "engines.json").read_text())
    assert [e["state"] for e in state["engines"]] == ["serving", "serving"] and state["restarts"] == 0


KILLER = '''
"""The calculator, which SIGKILLs engine server 0 once, at the first tool call of rollout 3: between the
turns of every trajectory of that rollout, while other trajectories' turns are in flight."""
import json
import os
import signal
from pathlib import Path

from miles.rollout.tools.builtin import execute_tool as calculator

RUN = Path({run!r})
DONE = RUN.parent / "killed-pid.txt"


async def execute_tool(name, params):
    answer = await calculator(name, params)
    metrics = RUN / "metrics.jsonl"
    if not DONE.exists() and metrics.exists() and any(json.loads(l).get("step", 0) >= 3 for l in metrics.read_text().splitlines()):
        pid = json.loads((RUN / "engines.json").read_text())["engines"][0]["pid"]
        DONE.write_text(str(pid))
        os.kill(pid, signal.SIGKILL)
    return answer
'''


@pytest.mark.slow
@pytest.mark.timeout(RUN_TIMEOUT_S + 2 * SERVER_TIMEOUT_S + 300)
def test_a_killed_engine_server_resumes_multi_turn_trajectories_from_their_last_complete_turn(work, two_servers):
    pytest.importorskip("sglang_router")
    run_dir = work / "runs" / "killed"
    hook = work / "killer.py"
    hook.write_text(KILLER.format(run=str(run_dir)))
    extra = (f"{SERVERS} --use-fault-tolerance --rollout-health-check-interval 1 --rollout-health-check-timeout 10 "
             f"--generate-execute-tool-function-path {hook}:execute_tool")  # fmt: skip
    r = subprocess.run(MILES + ["full-train", *RECIPE, *dirs(work, "killed"), "--extra-args", extra], cwd=work,
                       capture_output=True, text=True, timeout=SERVER_TIMEOUT_S)  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    killed = int((work / "runs" / "killed-pid.txt").read_text())
    assert f"pid {killed}" in r.stdout + r.stderr, r.stdout[-4000:]
    assert series(run_dir, "rollout/engine_restarts")[20] == 1.0
    assert series(run_dir, "rollout/requeued_requests")[20] > 0  # turns were in flight on the killed engine
    # Their requests (same ids, same seed) regenerated the same turns on the live engine, so every
    # trajectory is the undisturbed run's: the run ends exactly where that one does.
    for key in ("rollout/raw_reward", "rollout/tool_call_rate", "rollout/num_turns", "eval/tools/reward"):
        assert series(run_dir, key) == series(two_servers, key), key
