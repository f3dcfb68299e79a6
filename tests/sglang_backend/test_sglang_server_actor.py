"""The SGLang engine actor, the built-in server as an SGLang command, and the fleet's request cap.

Fast (no Ray, no router): `SGLangServerActor` is a plain class, run here in-process with the built-in
engine server as `--sglang-server-command`; the fleet's --sglang-server-concurrency queue is driven
with a client whose futures the test resolves by hand.

Run: `pytest tests/sglang_backend/test_sglang_server_actor.py` (about 20 s: two model loads).
"""

from __future__ import annotations

import collections
import concurrent.futures
import json
import sys
import threading
import time
import urllib.request

import pytest

from miles.config.resolve import build_config, resolve
from miles.errors import UserError
from miles.prepare.tiny_model import create_tiny_qwen3
from miles.rollout.engine.base import GenerateRequest, SamplingParams
from miles.rollout.engine.fleet import EngineFleet
from miles.rollout.sglang.launch import EngineSlot, server_argv
from miles.rollout.sglang.preflight import check_can_launch
from miles.ray.sglang_server_actor import SGLangServerActor

BUILTIN = f"{sys.executable} -m miles.rollout.engine.server"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return create_tiny_qwen3(tmp_path_factory.mktemp("tiny") / "model", seed=0)


def config(model, **values):
    base = {
        "rollout_backend": "sglang", "hf_checkpoint": str(model), "prompt_data": "p.jsonl", "rollout_batch_size": 2,
        "global_batch_size": 2, "num_rollout": 1, "actor_num_gpus_per_node": 1, "device": "cpu", "sglang_server_command": BUILTIN,
    }  # fmt: skip
    return resolve(build_config({**base, **values}, environ={}))


def post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


def test_engine_actor_starts_the_built_in_server_from_sglang_argv_and_stops_it(model, tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")  # what Ray or the machine may have set
    actor = SGLangServerActor(config(model, rollout_seed=5), index=1, seed=1006, log_dir=str(tmp_path))
    try:
        assert actor.argv[:4] == [sys.executable, "-m", "miles.rollout.engine.server", "--model-path"]
        assert actor.argv[actor.argv.index("--random-seed") + 1] == "1006"
        assert actor.cuda_visible_devices == ""  # --device cpu: the server sees no GPU
        assert actor.url().startswith("http://127.0.0.1:") and actor.pid() == actor.process.pid
        out = post(actor.url() + "/generate", {"input_ids": [3, 4, 5], "sampling_params": {"max_new_tokens": 3, "temperature": 0}, "return_logprob": True})
        assert len(out["output_ids"]) == 3 and len(out["meta_info"]["output_token_logprobs"]) == 3
    finally:
        actor.stop()
    assert actor.process.poll() is not None
    log = (tmp_path / "sglang-engine-1.log").read_text()
    assert log.startswith(f"[miles] engine 1: {BUILTIN} --model-path {model} ")
    assert "stopping: 1 /generate requests, 3 tokens" in log  # the server's summary on SIGTERM


def test_engine_actor_fails_fast_naming_the_engine_when_its_server_exits(model, tmp_path):
    cfg = config(model, sglang_server_command=f"{sys.executable} -c 'import sys; print(\"bad\" + \"-flag-\" + \"said\"); sys.exit(3)'")
    t0 = time.monotonic()
    with pytest.raises(RuntimeError) as e:
        SGLangServerActor(cfg, index=0, seed=0, log_dir=str(tmp_path))
    assert time.monotonic() - t0 < 30
    message = str(e.value)
    assert "SGLang engine 0" in message and "exited with code 3" in message and "sglang-engine-0.log" in message
    assert "bad-flag-said" in message  # the log's tail comes with the error (the command line alone does not say it)


def test_engine_actor_times_out_naming_what_it_waited_for(model, tmp_path):
    cfg = config(model, sglang_server_command=f"{sys.executable} -c 'import time; time.sleep(60)'", sglang_server_start_timeout=2.0)
    with pytest.raises(RuntimeError, match=r"SGLang engine 0 .* did not answer http://127\.0\.0\.1:\d+/health within 2 s"):
        SGLangServerActor(cfg, index=0, seed=0, log_dir=str(tmp_path))


def test_built_in_server_takes_the_sglang_argv_and_refuses_flags_it_cannot_honour(model, capsys):
    argv = server_argv(config(model), EngineSlot(index=0, host="127.0.0.1", port=0, nccl_port=1))[3:]
    from miles.rollout.engine.server import parse_args

    args = parse_args(argv)
    assert (args.model, args.host, args.port, args.seed, args.tp_size) == (str(model), "127.0.0.1", 0, 42, 1)
    for extra, message in [
        (["--mem-fraction-static", "0.5"], "--mem-fraction-static is an SGLang server flag the built-in engine server does not implement; drop the matching --sglang-mem-fraction-static"),
        (["--tp-size", "0"], "--tp-size 0: an engine has at least one TP rank"),
    ]:  # fmt: skip
        with pytest.raises(SystemExit) as e:
            parse_args(argv + extra)
        assert e.value.code == 2 and message in capsys.readouterr().err


def test_preflight_counts_no_gpus_with_device_cpu(model):
    check_can_launch(config(model), gpus=0)  # every "GPU" is a CPU process, the server command is not SGLang's
    with pytest.raises(UserError, match="add --device cpu for CPU servers"):
        check_can_launch(config(model, device="auto"), gpus=0)


class _Client:
    """Stands in for the router client: records requests, the test finishes them."""

    def __init__(self):
        self.sent: list[tuple[GenerateRequest, concurrent.futures.Future]] = []

    def submit(self, request):
        f = concurrent.futures.Future()
        self.sent.append((request, f))
        return f


def _fleet(limit: int) -> tuple[EngineFleet, _Client]:
    fleet = EngineFleet.__new__(EngineFleet)  # only the submit/abort path, without servers
    fleet._lock, fleet._max_in_flight, fleet._in_flight, fleet._waiting = threading.RLock(), limit, 0, collections.deque()
    fleet._pending, fleet.fatal, fleet.slots, fleet.requeued = set(), None, [], 0
    fleet._pool = concurrent.futures.ThreadPoolExecutor(1)
    fleet._router_client = _Client()
    return fleet, fleet._router_client


def test_fleet_sends_at_most_sglang_server_concurrency_times_engines_requests_at_once():
    from miles.rollout.engine.base import GenerateResponse

    fleet, client = _fleet(limit=2)
    futures = [fleet.submit(GenerateRequest([1], SamplingParams(max_new_tokens=1), rid=f"r{i}")) for i in range(5)]
    assert [r.rid for r, _ in client.sent] == ["r0", "r1"]
    client.sent[0][1].set_result(GenerateResponse([7], "", "stop", 1, rid="r0"))
    assert futures[0].result().output_ids == [7]
    assert [r.rid for r, _ in client.sent] == ["r0", "r1", "r2"]  # the finished one's place, in order
    fleet.abort_request("r4")  # never sent: answered "abort" at once, and never sent later
    assert futures[4].result(timeout=1).finish_type == "abort"
    for i in (1, 2):
        client.sent[i][1].set_result(GenerateResponse([], "", "stop", 1, rid=f"r{i}"))
    assert [r.rid for r, _ in client.sent] == ["r0", "r1", "r2", "r3"] and fleet._in_flight == 1
