"""Weight sync to engines of TP > 1, on CPU: built-in engine servers started with `tp_size=2` join the
broadcast group with one member per simulated TP rank and take one tensor payload per rank, so the
senders' rank offsets and payload counts are tested for real; memory release/resume by tag.

Servers run in this process (threads) and bind 127.0.0.1.
"""

from __future__ import annotations

import time

import pytest
import requests
import torch

from miles.prepare.tiny_model import create_tiny_qwen3
from miles.rollout.engine import weight_transport
from miles.rollout.engine.base import GenerateRequest, SamplingParams, weights_checksum
from miles.rollout.engine.builtin import BuiltinEngine
from miles.rollout.engine.http_client import EngineHTTPError, HttpEngine
from miles.rollout.engine.server import EngineServer
from miles.rollout.engine.weight_transport import (
    BroadcastTargets,
    EngineTarget,
    TensorTargets,
    engine_payloads,
    engines_of,
    rank_offsets,
)

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> str:
    return str(create_tiny_qwen3(tmp_path_factory.mktemp("tp") / "hf", seed=0))


@pytest.fixture(scope="module")
def tp2_servers(hf_dir):
    out = [EngineServer(BuiltinEngine(hf_dir, seed=i), tp_size=2) for i in range(2)]
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


def _sync(sender, clients, named, version):
    for c in clients:
        c.pause_generation()
        c.begin_weight_update()
    sender.begin(version)
    for bucket in (named[:5], named[5:12], named[12:]):
        sender.send_bucket(bucket, version)
    sender.finish(version)
    for c in clients:
        c.end_weight_update(version)
        c.continue_generation()


def test_rank_offsets_are_cumulative_over_engine_tp_sizes():
    assert rank_offsets(engines_of(["a", "b", "c"], [2, 4, 1])) == (8, [1, 3, 7])
    assert rank_offsets(engines_of(["a", "b"])) == (3, [1, 2])


def test_two_tp2_engines_receive_bit_exact_weights_by_broadcast(hf_dir, tp2_servers, monkeypatch):
    named = _new_weights(hf_dir, 0.06)
    urls = [s.url for s in tp2_servers]
    clients = [HttpEngine(u) for u in urls]
    bodies = []
    post = weight_transport._post
    monkeypatch.setattr(weight_transport, "_post", lambda url, path, body, *a, **k: (bodies.append((url, path, body)), post(url, path, body, *a, **k))[1])
    sender = BroadcastTargets(engines_of(urls, [2, 2]), timeout_s=60).open_sender()
    try:
        _sync(sender, clients, named, 11)
    finally:
        sender.close()
    joins = [b for _, p, b in bodies if p == "/init_weights_update_group"]
    assert [(b["rank_offset"], b["world_size"], b["backend"]) for b in joins] == [(1, 5, "gloo"), (3, 5, "gloo")]
    assert [c.get_weights_checksum() for c in clients] == [weights_checksum(named)] * 2
    info = clients[1].call("/server_info", method="GET")
    assert info["tp_size"] == 2
    resp = clients[0].submit(GenerateRequest([3, 4], SamplingParams(max_new_tokens=2), True)).result(60)
    assert resp.weight_version == 11


def test_an_engine_refuses_a_group_its_tp_ranks_do_not_fit(tp2_servers):
    r = requests.post(
        f"{tp2_servers[0].url}/init_weights_update_group",
        json={"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 2, "world_size": 3, "group_name": "g", "backend": "gloo"},
        timeout=30,
    )
    assert r.status_code == 400 and "rank_offset 2 + tp_size 2 exceeds the group's world size 3" in r.json()["message"]


def test_tensor_sync_sends_one_payload_per_engine_tp_rank(hf_dir, tp2_servers, monkeypatch):
    named = _new_weights(hf_dir, 0.07)
    urls = [s.url for s in tp2_servers]
    clients = [HttpEngine(u) for u in urls]
    counts = []
    post = weight_transport._post
    monkeypatch.setattr(
        weight_transport, "_post",
        lambda url, path, body, *a, **k: (counts.append(len(body.get("serialized_named_tensors", []))), post(url, path, body, *a, **k))[1],
    )  # fmt: skip
    sender = TensorTargets(engines_of(urls, [2, 2])).open_sender()
    try:
        _sync(sender, clients, named, 12)
    finally:
        sender.close()
    assert counts == [2] * 6  # 3 buckets x 2 engines, each a payload per TP rank
    assert [c.get_weights_checksum() for c in clients] == [weights_checksum(named)] * 2


def test_an_engine_refuses_a_tensor_update_with_a_payload_count_other_than_its_tp_size(hf_dir, tp2_servers):
    client = HttpEngine(tp2_servers[0].url)
    before = client.get_weights_checksum()
    sender = TensorTargets(engines_of([tp2_servers[0].url], [1])).open_sender()  # one payload for two ranks
    client.pause_generation()
    client.begin_weight_update()
    try:
        with pytest.raises(RuntimeError, match="1 payloads for an engine of 2 TP ranks"):
            sender.send_bucket(_new_weights(hf_dir, 0.08)[:2], 13)
    finally:
        client.end_weight_update(0)
        client.continue_generation()
        sender.close()
    assert client.get_weights_checksum() == before


def test_gpu_payloads_come_from_the_training_rank_on_each_tp_ranks_gpu():
    engines = (EngineTarget("http://e0", 2, (0, 1)), EngineTarget("http://e1", 2, (2, 3)))
    assert engine_payloads(engines, ["h0", "h1", "h2", "h3"]) == [["h0", "h1"], ["h2", "h3"]]
    with pytest.raises(RuntimeError, match="training rank 3 .* sent no copy"):
        engine_payloads(engines, ["h0", "h1", "h2"])
    with pytest.raises(RuntimeError, match="is not known"):
        engine_payloads((EngineTarget("http://e0", 2),), ["h0", "h1"])
    with pytest.raises(ValueError, match="1 gpu_ranks for 2 TP ranks"):
        EngineTarget("http://e0", 2, (0,))


def test_memory_is_released_and_resumed_by_tag_in_the_colocated_order(hf_dir):
    server = EngineServer(BuiltinEngine(hf_dir, seed=0))
    server.start()
    try:
        client = HttpEngine(server.url)
        client.release_memory_occupation()  # all tags, before the trainer runs
        client.resume_memory_occupation(["weights"])
        with pytest.raises(EngineHTTPError, match="'weights' is not released"):
            client.resume_memory_occupation(["weights"])  # SGLang's scheduler would die on this
        named = _new_weights(hf_dir, 0.09)
        sender = TensorTargets(engines_of([server.url])).open_sender()
        try:
            _sync(sender, [client], named, 14)
        finally:
            sender.close()
        client.resume_memory_occupation(["kv_cache", "cuda_graph"])
        with pytest.raises(EngineHTTPError, match="unknown memory tag 'gpu'"):
            client.release_memory_occupation(["gpu"])
        calls = [c for c in client.call("/server_info", method="GET")["control_calls"] if c != "/health_generate"]
        assert calls[: calls.index("/end_weight_update") + 3] == [
            "/release_memory_occupation weights,kv_cache,cuda_graph",
            "/resume_memory_occupation weights",
            "/resume_memory_occupation weights",  # the refused one
            "/pause_generation", "/begin_weight_update",
            "/update_weights_from_tensor", "/update_weights_from_tensor", "/update_weights_from_tensor",
            "/update_weight_version", "/end_weight_update",
            "/continue_generation",
            "/resume_memory_occupation kv_cache,cuda_graph",
        ]  # fmt: skip
        assert client.call("/server_info", method="GET")["released_memory"] == []
    finally:
        server.stop()


def test_release_is_refused_while_the_engine_is_busy(hf_dir):
    engine = BuiltinEngine(hf_dir, seed=0, max_batch_size=1)
    server = EngineServer(engine)
    server.start()
    try:
        client = HttpEngine(server.url)
        eos = engine.eos_token_ids
        engine.eos_token_ids = set()
        try:
            f = client.submit(GenerateRequest([3, 4], SamplingParams(max_new_tokens=4000), False, rid="long"))
            deadline = time.monotonic() + 60
            while not engine.health()["running"]:
                assert time.monotonic() < deadline, "the long request never started"
                time.sleep(0.01)
            with pytest.raises(EngineHTTPError, match="only when server is idle"):
                client.release_memory_occupation()
            client.abort_request(abort_all=True)
            assert f.result(60).finish_type == "abort"
        finally:
            engine.eos_token_ids = eos
        assert client.load() == 0
        client.release_memory_occupation()
        client.resume_memory_occupation()
    finally:
        server.stop()
