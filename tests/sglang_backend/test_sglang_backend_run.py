"""`--rollout-backend sglang` through the real CLI, on a CPU, without SGLang installed.

The SGLang backend's whole code path runs: miles builds each engine's SGLang argv
(`--model-path --host --port --tp-size 1 --random-seed ...`), Ray actors start one server process per
engine from `--sglang-server-command`, wait for `/health`, put them behind a real sglang-router, and
the rollout manager drives them through the HTTP client (generate through the router; pause, flush,
weight updates, continue on each engine). The server command is the built-in engine server, which
takes SGLang's flags and speaks SGLang's API subset, so only the program behind the command differs
from a GPU run with `python -m sglang.launch_server`.

One run of the tiny recipe (`--mode debug_minimal`, 4 rollouts, 2 engines, fault tolerance on, the
weight check after every sync) checks that:
- every engine ran the command miles built for it and answered /generate (each server prints its count
  when the run stops it), so the requests went through the launched servers and the router spread them;
- the samples of rollout k carry weight version k (the trainer's weights reached the servers);
- a server SIGKILLed after the first rollout was noticed, restarted from the same command, given the
  current weights, and the run finished with `rollout/engine_restarts` 1.

Slow: a whole `miles full-train` with Ray and three model processes, a few minutes on 2 busy cores.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("sglang_router")

MILES = [sys.executable, "-m", "miles_cli.main"]
SERVER_COMMAND = f"{sys.executable} -m miles.rollout.engine.server"


def rows(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.slow
def test_sglang_backend_drives_launched_servers_updates_weights_and_restarts_a_killed_one(tmp_path):
    run_dir = tmp_path / "runs" / "sg"
    extra = (
        f"--rollout-backend sglang --sglang-server-command '{SERVER_COMMAND}' --rollout-num-gpus 2 "
        "--use-fault-tolerance --rollout-health-check-interval 1 --rollout-health-check-timeout 20 "
        f"--num-rollout 4 --save-debug-rollout-data {run_dir}/rollouts/{{rollout_id}}.jsonl"
    )
    args = ["full-train", "--mode", "debug_minimal", "--hardware", "cpu", "--model-dir", str(tmp_path / "models"),
            "--data-dir", str(tmp_path / "data"), "--output-dir", str(tmp_path / "runs"), "--run-id", "sg", "--extra-args", extra]  # fmt: skip
    proc = subprocess.Popen(MILES + args, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    killed = None
    deadline = time.monotonic() + 1500
    while proc.poll() is None and time.monotonic() < deadline:
        if killed is None and any(r.get("step", -1) >= 0 for r in rows(run_dir)):
            killed = json.loads((run_dir / "engines.json").read_text())["engines"][0]["pid"]
            os.kill(killed, signal.SIGKILL)
        time.sleep(0.2)
    if proc.poll() is None:
        proc.kill()
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out[-5000:]
    assert killed is not None, "the run ended before its first rollout was logged"

    # Each engine ran the SGLang argv miles built, with the server command given.
    logs = {i: (run_dir / f"sglang-engine-{i}.log").read_text() for i in (0, 1)}
    for i, text in logs.items():
        starts = re.findall(r"^\[miles\] engine \d+: (.*)$", text, re.M)
        assert starts and all(s.startswith(SERVER_COMMAND + " --model-path ") and " --tp-size 1 " in s for s in starts), text[:2000]
    assert len(re.findall(r"^\[miles\] engine 0: ", logs[0], re.M)) == 2, "engine 0 was not started again after the kill"

    # The requests went through the launched servers: the restarted engine 0 and engine 1 both
    # answered /generate (round robin behind the router), and report it when the run stops them.
    served = {i: [int(n) for n in re.findall(r"stopping: (\d+) /generate requests", text)] for i, text in logs.items()}
    assert served[1] and served[1][-1] > 0, logs[1][-2000:]
    assert served[0] and served[0][-1] > 0, logs[0][-2000:]  # the restarted engine served once it had the weights

    # The trainer's weights reached the servers: rollout k was generated with weight version k.
    for k in range(4):
        versions = {json.loads(line)["weight_version"] for line in (run_dir / "rollouts" / f"{k}.jsonl").read_text().splitlines()}
        assert versions == {k}, (k, versions)

    # The kill was noticed, named, and the engine restarted with fault tolerance.
    state = json.loads((run_dir / "engines.json").read_text())
    assert state["restarts"] == 1 and [e["state"] for e in state["engines"]] == ["serving", "serving"], state
    assert state["engines"][0]["pid"] != killed
    assert f"pid {killed}" in out and "restarting it" in out, out[-3000:]
    restarts = [r["rollout/engine_restarts"] for r in rows(run_dir) if "rollout/engine_restarts" in r]
    assert restarts[-1] == 1.0, restarts
