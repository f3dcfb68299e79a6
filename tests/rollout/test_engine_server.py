"""The built-in engine as an SGLang-shaped HTTP server, the weight transports, and the real sglang-router.

Servers run in this process (threads), the router is the pinned Rust binary in a subprocess; all bind
127.0.0.1.
"""

from __future__ import annotations

import threading
import time

import pytest
import requests
import torch

from miles.prepare.tiny_model import create_tiny_qwen3
from miles.rollout.engine.base import GenerateRequest, SamplingParams, weights_checksum
from miles.rollout.engine.builtin import BuiltinEngine
from miles.rollout.engine.http_client import HttpEngine
from miles.rollout.engine.server import EngineServer
from miles.rollout.engine.weight_transport import BroadcastTargets, DiskTargets, engines_of

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> str:
    return str(create_tiny_qwen3(tmp_path_factory.mktemp("srv") / "hf", seed=0))


@pytest.fixture(scope="module")
def servers(hf_dir):
    out = [EngineServer(BuiltinEngine(hf_dir, seed=i)) for i in range(2)]
    for s in out:
        s.start()
    yield out
    for s in out:
        s.stop()


def _new_weights(hf_dir: str, shift: float) -> list[tuple[str, torch.Tensor]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir)
    g = torch.Generator().manual_seed(int(shift * 1000))
    return [(n, p.detach() + shift * torch.randn(p.shape, generator=g)) for n, p in model.named_parameters()]


def test_generate_speaks_sglang_and_matches_the_in_process_engine(hf_dir, servers):
    url = servers[0].url
    local = BuiltinEngine(hf_dir)
    body = {
        "input_ids": [[3, 4, 5], [6, 7]],
        "sampling_params": [{"max_new_tokens": 5, "sampling_seed": 7}, {"max_new_tokens": 3, "temperature": 0}],
        "rid": ["a-1", "a-2"],
        "return_logprob": True,
    }
    out = requests.post(f"{url}/generate", json=body, timeout=60).json()
    assert [o["meta_info"]["id"] for o in out] == ["a-1", "a-2"]
    want = local.generate([GenerateRequest([3, 4, 5], SamplingParams(max_new_tokens=5, seed=7), True)])[0]
    first = out[0]
    assert first["output_ids"] == want.output_ids and first["text"] == want.text
    triples = first["meta_info"]["output_token_logprobs"]  # SGLang: [logprob, token id, text]
    assert [t[1] for t in triples] == want.output_ids
    assert [t[0] for t in triples] == pytest.approx(want.output_token_logprobs, abs=1e-6)
    assert first["meta_info"]["finish_reason"] == want.finish_reason
    assert first["meta_info"]["weight_version"] == "0"
    # The client reads the same answer back into a GenerateResponse.
    resp = HttpEngine(url).submit(GenerateRequest([3, 4, 5], SamplingParams(max_new_tokens=5, seed=7), True)).result(60)
    assert resp.output_ids == want.output_ids and resp.weight_version == 0
    # Bad requests are 400 with a message, not a dead server.
    bad = requests.post(f"{url}/generate", json={"input_ids": [1], "sampling_params": {"frequency_penalty": 1.0}}, timeout=10)
    assert bad.status_code == 400 and "frequency_penalty" in bad.json()["error"]["message"]
    info = requests.get(f"{url}/model_info", timeout=10).json()
    assert info["model_path"] == hf_dir and info["weight_version"] == "0"
    assert requests.get(f"{url}/health_generate", timeout=30).status_code == 200


def test_pause_aborts_in_flight_and_abort_request_matches_prefixes(servers):
    client = HttpEngine(servers[1].url)
    engine = servers[1].engine
    long = SamplingParams(max_new_tokens=5000, temperature=1.0, stop_token_ids=[])
    eos = engine.eos_token_ids
    engine.eos_token_ids = frozenset()
    try:
        a = [client.submit(GenerateRequest([1, 2], long, rid=f"grp-1-{i}")) for i in range(2)]
        b = client.submit(GenerateRequest([1, 3], SamplingParams(max_new_tokens=4), rid="grp-2-0"))
        time.sleep(0.5)
        client.abort_request("grp-1-")
        assert all(f.result(60).finish_type == "abort" for f in a)
        assert b.result(60).finish_type in ("length", "stop")
        c = client.submit(GenerateRequest([1, 2], long, rid="x"))
        time.sleep(0.3)
        client.pause_generation()
        assert c.result(60).finish_type == "abort"
        assert requests.get(f"{client.url}/health_generate", timeout=30).status_code == 503  # paused on purpose
        held = client.submit(GenerateRequest([1, 2], SamplingParams(max_new_tokens=2), rid="y"))
        time.sleep(0.3)
        assert not held.done()  # SGLang: new requests wait while paused
        client.continue_generation()
        assert held.result(60).finish_type == "length"
    finally:
        engine.eos_token_ids = eos


@pytest.mark.parametrize("mode", ["broadcast", "disk"])
def test_weight_transports_leave_every_engine_bit_identical(hf_dir, servers, tmp_path, mode):
    named = _new_weights(hf_dir, 0.01 if mode == "broadcast" else 0.02)
    want = weights_checksum(named)
    urls = [s.url for s in servers]
    clients = [HttpEngine(u) for u in urls]
    for c in clients:
        c.pause_generation()
        c.begin_weight_update()
    if mode == "broadcast":
        sender = BroadcastTargets(engines_of(urls)).open_sender()
    else:
        sender = DiskTargets(engines_of(urls), directory=str(tmp_path / "sync"), hf_checkpoint=hf_dir).open_sender()
    buckets = [named[:5], named[5:12], named[12:]]
    sender.begin(9)
    for bucket in buckets:
        sender.send_bucket(bucket, 9)
    sender.finish(9)
    if mode == "disk":
        assert sorted(p.name for p in (tmp_path / "sync").glob("*.safetensors")) == [f"model-0000{i}.safetensors" for i in (1, 2, 3)]
    for c in clients:
        c.end_weight_update(9)
        c.continue_generation()
    sender.close()
    assert [c.get_weights_checksum() for c in clients] == [want, want]
    resp = clients[0].submit(GenerateRequest([3, 4], SamplingParams(max_new_tokens=2), True)).result(60)
    assert resp.weight_version == 9


def test_two_servers_behind_the_real_router(hf_dir, servers, tmp_path):
    pytest.importorskip("sglang_router")
    from miles.rollout.engine.router import Router

    router = Router.launch([s.url for s in servers], policy="round_robin", log_dir=tmp_path)
    try:
        assert router.url.startswith("http://127.0.0.1:")
        before = [s.engine.health()["requests"] for s in servers]
        client = HttpEngine(servers[0].url, generate_url=router.url)
        futures = [client.submit(GenerateRequest([3, 4, i + 5], SamplingParams(max_new_tokens=3), True, rid=f"r{i:03d}")) for i in range(10)]
        out = [f.result(60) for f in futures]
        assert [r.rid for r in out] == [f"r{i:03d}" for i in range(10)]
        after = [s.engine.health()["requests"] for s in servers]
        assert [a - b for a, b in zip(after, before)] == [5, 5]  # round robin, through the router
        # The router forwards /generate only; control calls go to each engine (sglang-router 0.3.2: 404).
        assert requests.post(f"{router.url}/pause_generation", json={}, timeout=10).status_code == 404
        router.remove_worker(servers[0].url)
        assert [w["url"] for w in router.workers()] == [servers[1].url]
        router.add_worker(servers[0].url)
        assert sorted(w["url"] for w in router.workers()) == sorted(s.url for s in servers)
    finally:
        router.stop()
    assert router.process.poll() is not None


def test_broadcast_group_address_is_loopback_only_when_every_engine_is_local(monkeypatch):
    """Engines on another node cannot reach 127.0.0.1: the rendezvous address is then this node's on the
    route to them."""
    from miles.rollout.engine import weight_transport
    from miles.rollout.engine.weight_transport import group_master_address

    monkeypatch.setattr(weight_transport, "address_toward", lambda host: "10.1.2.3")
    assert group_master_address(["http://127.0.0.1:31001", "http://localhost:31002"]) == "127.0.0.1"
    assert group_master_address(["http://127.0.0.1:31001", "http://10.1.2.4:31002"]) == "10.1.2.3"
