"""Opt-in: a real SGLang server, started from miles' own argv, serves the tiny model on the CPU.

Skipped unless MILES_SGLANG_CPU_PYTHON names an interpreter whose environment has the pinned SGLang
(build one with `bash scripts/setup_sglang_cpu.sh`). Then the test creates the tiny Qwen3, resolves
a miles config with `--rollout-backend sglang --sglang-server-command "<that python> -m
sglang.launch_server" --sglang-device cpu --sglang-max-total-tokens 2048`, starts the server from
`server_argv(...)`, waits with `wait_healthy`, puts it behind a real sglang-router started from
`router_argv(...)`, and runs a few rollout-shaped `/generate` requests (token ids in, token ids and
per-token logprobs out) through the router.

Run: `bash scripts/setup_sglang_cpu.sh && MILES_SGLANG_CPU_PYTHON=$PWD/.sglang-cpu/bin/python \
pytest -m slow tests/sglang_backend/test_sglang_cpu_server.py` (a minute or two after setup).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import urllib.request
from pathlib import Path

import pytest

from miles.config.resolve import build_config, resolve
from miles.rollout.sglang import SGLANG_VERSION
from miles.rollout.sglang.launch import EngineSlot, register_worker, router_argv, server_argv, wait_healthy

PYTHON = os.environ.get("MILES_SGLANG_CPU_PYTHON")
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not PYTHON, reason="opt-in: set MILES_SGLANG_CPU_PYTHON (bash scripts/setup_sglang_cpu.sh)"),
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(url: str, body: dict, timeout: float = 120) -> dict:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


def test_real_sglang_cpu_server_behind_the_router(tmp_path):
    from miles.prepare.tiny_model import create_tiny_qwen3

    version = subprocess.run([PYTHON, "-c", "import sglang; print(sglang.__version__)"], capture_output=True, text=True, timeout=300)
    assert version.stdout.strip() == SGLANG_VERSION, version.stderr
    model = create_tiny_qwen3(tmp_path / "tiny")
    cfg = resolve(
        build_config(
            {
                "rollout_backend": "sglang", "hf_checkpoint": str(model), "prompt_data": "unused.jsonl", "num_rollout": 1,
                "rollout_batch_size": 1, "global_batch_size": 1, "actor_num_gpus_per_node": 1,
                "sglang_server_command": f"{PYTHON} -m sglang.launch_server", "sglang_device": "cpu",
                "sglang_max_total_tokens": 2048, "sglang_router_command": f"{PYTHON} -m sglang_router.launch_router",
                "sglang_router_policy": "round_robin",
            },
            environ={},
        )
    )  # fmt: skip
    port, router_port = free_port(), free_port()
    env = {**os.environ, "SGLANG_USE_CPU_ENGINE": "1"}
    log = open(tmp_path / "server.log", "w")
    server = subprocess.Popen(server_argv(cfg, EngineSlot(0, "127.0.0.1", port, free_port())), stdout=log, stderr=subprocess.STDOUT, env=env)
    router = None
    try:
        wait_healthy(f"http://127.0.0.1:{port}", what="the SGLang CPU server", timeout_s=600, process=server)
        router = subprocess.Popen(
            router_argv(cfg, host="127.0.0.1", port=router_port, prometheus_port=free_port()),
            stdout=open(tmp_path / "router.log", "w"), stderr=subprocess.STDOUT,
        )
        wait_healthy(f"http://127.0.0.1:{router_port}", what="sglang-router", timeout_s=120, process=router)
        register_worker(f"http://127.0.0.1:{router_port}", f"http://127.0.0.1:{port}")
        wait_healthy(f"http://127.0.0.1:{router_port}", what="the router's worker", path="/readiness", timeout_s=120)
        for step in range(3):
            out = post(
                f"http://127.0.0.1:{router_port}/generate",
                {"input_ids": [3, 4, 5, 6], "sampling_params": {"temperature": 1.0, "max_new_tokens": 8}, "return_logprob": True},
            )
            assert 1 <= len(out["output_ids"]) <= 8, out
            logprobs = out["meta_info"]["output_token_logprobs"]
            assert len(logprobs) == len(out["output_ids"]) and all(lp[0] <= 0 for lp in logprobs), (step, out)
    finally:
        for proc in (router, server):
            if proc is not None:
                proc.terminate()
                proc.wait(timeout=60)
        print(Path(tmp_path / "server.log").read_text()[-3000:])
