"""Opt-in: `miles full-train --rollout-backend sglang` with real SGLang servers on the CPU.

Skipped unless MILES_SGLANG_CPU_PYTHON names an interpreter whose environment has the pinned SGLang
(build one with `bash scripts/setup_sglang_cpu.sh`). Then the tiny recipe runs through the CLI exactly
as on GPUs, only with `--sglang-server-command "<that python> -m sglang.launch_server"` and the CPU
settings SGLang needs (`--sglang-device cpu --sglang-max-total-tokens 2048`, SGLANG_USE_CPU_ENGINE=1):
the engine actor starts the real server from miles' argv, waits for it, puts it behind sglang-router,
and the rollouts, the broadcast weight updates (over SGLang's own `init_weights_update_group`), the
eval and the checkpoints go through it. The test checks that the server was SGLang's, that rollout k
was generated with weight version k, and that the run finished.

Run: `bash scripts/setup_sglang_cpu.sh && MILES_SGLANG_CPU_PYTHON=$PWD/.sglang-cpu/bin/python \
pytest -m slow tests/sglang_backend/test_sglang_cpu_server.py` (a few minutes: SGLang takes 1-2 min
to start on a CPU).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from miles.rollout.sglang import SGLANG_VERSION

PYTHON = os.environ.get("MILES_SGLANG_CPU_PYTHON")
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not PYTHON, reason="opt-in: set MILES_SGLANG_CPU_PYTHON (bash scripts/setup_sglang_cpu.sh)"),
]
MILES = [sys.executable, "-m", "miles_cli.main"]


@pytest.mark.parametrize("transfer", ["broadcast", "disk", "tensor"])
def test_miles_runs_its_rollouts_on_a_real_sglang_cpu_server(tmp_path, transfer):
    version = subprocess.run([PYTHON, "-c", "import sglang; print(sglang.__version__)"], capture_output=True, text=True, timeout=300)
    assert version.stdout.strip() == SGLANG_VERSION, version.stderr
    run_dir = tmp_path / "runs" / "real"
    extra = (
        f"--rollout-backend sglang --sglang-server-command '{PYTHON} -m sglang.launch_server' --sglang-device cpu "
        "--sglang-max-total-tokens 2048 --no-offload-rollout --no-check-weight-update-equal "
        f"--update-weight-transfer-mode {transfer} --save-debug-rollout-data {run_dir}/rollouts/{{rollout_id}}.jsonl"
    )
    args = ["full-train", "--mode", "debug_minimal", "--hardware", "cpu", "--model-dir", str(tmp_path / "models"),
            "--data-dir", str(tmp_path / "data"), "--output-dir", str(tmp_path / "runs"), "--run-id", "real", "--extra-args", extra]  # fmt: skip
    env = {**os.environ, "SGLANG_USE_CPU_ENGINE": "1"}
    r = subprocess.run(MILES + args, cwd=tmp_path, capture_output=True, text=True, timeout=2400, env=env)
    log = (run_dir / "sglang-engine-0.log").read_text() if (run_dir / "sglang-engine-0.log").exists() else ""
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:] + log[-4000:]
    assert log.startswith(f"[miles] engine 0: {PYTHON} -m sglang.launch_server --model-path ")
    assert "The server is fired up and ready to roll!" in log  # SGLang's own line: a real SGLang server answered
    for k in range(3):
        versions = {json.loads(line)["weight_version"] for line in (run_dir / "rollouts" / f"{k}.jsonl").read_text().splitlines()}
        assert versions == {k}, (k, versions)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert any("eval/arith/accuracy" in row for row in rows) and any("train/loss" in row or "train/pg_loss" in row for row in rows)
