"""The tensor weight path (`--update-weight-transfer-mode tensor`, SGLang's `/update_weights_from_tensor`).

The sender and a built-in engine server in *another process* (so shared memory really crosses a
process boundary), the payload format against SGLang 0.5.23's allow-list, the allow-list unpickler
refusing anything else, and the option's rules (exit 2 where handles cannot reach the engine).

Run: `pytest tests/rollout/test_weight_tensor_path.py` (about half a minute: one server process).
"""

from __future__ import annotations

import base64
import io
import json
import os
import pickle
import subprocess
import sys

import pytest
import requests
import torch

from miles.config.resolve import build_config, resolve
from miles.errors import UserError
from miles.prepare.tiny_model import create_tiny_qwen3
from miles.rollout.engine import weight_transport
from miles.rollout.engine.base import GenerateRequest, SamplingParams, weights_checksum
from miles.rollout.engine.http_client import EngineHTTPError, HttpEngine
from miles.rollout.engine.tensor_ipc import ALLOWED_GLOBALS, deserialize_payload, flatten_bucket, serialize_bucket
from miles.rollout.engine.weight_transport import TensorTargets, engines_of

torch.set_num_threads(1)

# The globals of SGLang 0.5.23's SafeUnpickler.ALLOWED_GLOBALS (sglang/srt/utils/common.py:3148) that a
# payload of CPU or CUDA tensors can need; a payload naming anything else fails on a real SGLang engine.
SGLANG_ALLOWS = {
    ("torch", "Tensor"), ("torch", "Size"), ("torch", "device"), ("torch.nn.parameter", "Parameter"),
    ("torch.storage", "UntypedStorage"), ("torch.storage", "TypedStorage"), ("torch", "UntypedStorage"),
    ("torch.multiprocessing.reductions", "rebuild_tensor"), ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"),
    ("torch.multiprocessing.reductions", "rebuild_storage_filename"), ("torch.multiprocessing.reductions", "rebuild_typed_storage"),
    ("torch", "float32"), ("torch", "bfloat16"), ("torch", "float16"), ("torch", "int64"), ("torch", "int32"), ("torch", "uint8"),
}  # fmt: skip


def _globals_of(payload: str) -> set[tuple[str, str]]:
    """(module, name) of every global a payload names (unpickled here by plain pickle, which records them)."""
    seen = set()

    class Recorder(pickle.Unpickler):
        def find_class(self, module, name):
            seen.add((module, name))
            return super().find_class(module, name)

    Recorder(io.BytesIO(base64.b64decode(payload))).load()
    return seen


def _bucket() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    return [
        ("w", torch.randn(5, 7, generator=g)),
        ("half", torch.randn(9, generator=g).to(torch.bfloat16)),  # 18 bytes: the next tensor is realigned
        ("ids", torch.arange(11)),
        ("transposed", torch.randn(4, 3, generator=g).t()),  # not contiguous: sent as its values
        ("scalar", torch.tensor(2.5)),
    ]


def test_a_payload_carries_handles_and_rebuilds_bit_exact_in_another_process():
    bucket = _bucket()
    flat, views = flatten_bucket(bucket)
    payload = serialize_bucket(views)
    assert len(payload) < 2000  # handles (a segment name), not the 300-odd bytes of values... nor a copy of them
    names = _globals_of(payload)
    assert names <= SGLANG_ALLOWS, names - SGLANG_ALLOWS  # a real SGLang engine accepts it
    assert ("torch.multiprocessing.reductions", "rebuild_storage_filename") in names  # shared memory by name, not an fd
    code = (
        "import sys, json; from miles.rollout.engine.tensor_ipc import deserialize_payload\n"
        "from miles.rollout.engine.base import weights_checksum\n"
        "named = deserialize_payload(sys.stdin.read())\n"
        "print(json.dumps([[n, str(t.dtype), list(t.shape)] for n, t in named])); print(weights_checksum(named))"
    )
    r = subprocess.run([sys.executable, "-c", code], input=payload, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    meta, checksum = r.stdout.splitlines()
    assert json.loads(meta) == [[n, str(t.dtype), list(t.shape)] for n, t in bucket]
    assert checksum == weights_checksum(bucket)
    del flat, views


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none here: this path did not run in CI)")
def test_a_cuda_payload_names_the_gpu_by_uuid_and_rebuilds_bit_exact_in_another_process():
    bucket = [(n, t.cuda()) for n, t in _bucket()]
    flat, views = flatten_bucket(bucket)
    payload = serialize_bucket(views)
    seen = []

    class Recorder(pickle.Unpickler):
        def find_class(self, module, name):
            if (module, name) == ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"):
                return lambda *args: seen.append(args[6])
            return super().find_class(module, name)

    Recorder(io.BytesIO(base64.b64decode(payload))).load()
    assert seen and all(d == str(torch.cuda.get_device_properties(0).uuid) for d in seen)  # not the index 0
    code = (
        "import sys; from miles.rollout.engine.tensor_ipc import deserialize_payload\n"
        "from miles.rollout.engine.base import weights_checksum\n"
        "print(weights_checksum([(n, t.cpu()) for n, t in deserialize_payload(sys.stdin.read())]))"
    )
    fresh = serialize_bucket(views)  # the one above was consumed by the recorder
    r = subprocess.run([sys.executable, "-c", code], input=fresh, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == weights_checksum([(n, t.cpu()) for n, t in bucket])
    del flat, views


class _Shell:
    def __reduce__(self):
        return (os.system, ("touch pwned",))


def test_the_unpickler_admits_only_tensor_rebuilds(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    hostile = base64.b64encode(pickle.dumps([("w", _Shell())])).decode()
    with pytest.raises(pickle.UnpicklingError, match=r"global (posix|os)\.system"):
        deserialize_payload(hostile)
    assert not (tmp_path / "pwned").exists()
    with pytest.raises(pickle.UnpicklingError, match="builtins.eval"):
        deserialize_payload(base64.b64encode(b"cbuiltins\neval\n(S'1'\ntR.").decode())
    # What the producer writes is exactly what the unpickler lets in (dtypes aside).
    _, views = flatten_bucket(_bucket())
    assert {n for n in _globals_of(serialize_bucket(views)) if n[0] != "torch" or n[1] in ("Tensor", "Size")} <= set(ALLOWED_GLOBALS)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> str:
    return str(create_tiny_qwen3(tmp_path_factory.mktemp("tensor") / "hf", seed=0))


@pytest.fixture(scope="module")
def server_url(hf_dir):
    """A built-in engine server in its own process (the way --rollout-num-gpus runs them)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "miles.rollout.engine.server", "--hf-checkpoint", hf_dir, "--port", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    url = proc.stdout.readline().strip()
    assert url.startswith("http://127.0.0.1:"), proc.stderr.read() if proc.poll() is not None else url
    yield url
    proc.terminate()
    proc.wait(30)


def _new_weights(hf_dir: str, shift: float) -> list[tuple[str, torch.Tensor]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir)
    g = torch.Generator().manual_seed(int(shift * 1000))
    return [(n, p.detach() + shift * torch.randn(p.shape, generator=g)) for n, p in model.named_parameters()]


def test_tensor_updates_leave_the_server_bit_identical_to_the_trainer_export(hf_dir, server_url, monkeypatch):
    named = _new_weights(hf_dir, 0.03)
    want = weights_checksum(named)
    client = HttpEngine(server_url)
    assert client.get_weights_checksum() != want
    bodies = []
    post = weight_transport._post
    monkeypatch.setattr(weight_transport, "_post", lambda url, path, body, *a: (bodies.append((path, body)), post(url, path, body, *a))[1])
    client.pause_generation()
    client.begin_weight_update()
    sender = TensorTargets(engines_of([server_url])).open_sender()
    buckets = [named[:4], named[4:9], named[9:]]
    for bucket in buckets:
        sender.send_bucket(bucket, 7)
    sender.finish(7)
    client.end_weight_update(7)
    client.continue_generation()
    assert client.get_weights_checksum() == want  # every bucket arrived, bit for bit
    assert [p for p, _ in bodies] == ["/update_weights_from_tensor"] * 3
    for (_, body), bucket in zip(bodies, buckets):  # SGLang's body: no bytes, one payload per TP rank, no flush
        assert body["flush_cache"] is False and body["load_format"] is None and body["weight_version"] == "7"
        assert len(body["serialized_named_tensors"]) == 1
        assert len(json.dumps(body)) < 0.05 * sum(t.numel() * t.element_size() for _, t in bucket)
    resp = client.submit(GenerateRequest([3, 4], SamplingParams(max_new_tokens=2), True)).result(60)
    assert resp.weight_version == 7
    # The next sync reuses the sender's buffer (largest bucket first, so every later one overwrites it).
    buffer = sender._buffer
    again = _new_weights(hf_dir, 0.04)
    client.pause_generation()
    client.begin_weight_update()
    for bucket in sorted([again[:4], again[4:9], again[9:]], key=lambda b: -sum(t.numel() for _, t in b)):
        sender.send_bucket(bucket, 8)
    sender.finish(8)
    client.end_weight_update(8)
    client.continue_generation()
    assert sender._buffer is buffer
    assert client.get_weights_checksum() == weights_checksum(again)
    sender.close()


def test_a_hostile_or_out_of_session_update_is_refused_and_changes_nothing(hf_dir, server_url, tmp_path):
    client = HttpEngine(server_url)
    before = client.get_weights_checksum()
    _, views = flatten_bucket(_new_weights(hf_dir, 0.05)[:2])
    body = {"serialized_named_tensors": [serialize_bucket(views)], "load_format": None, "flush_cache": False}
    with pytest.raises(EngineHTTPError, match="begin_weight_update"):
        client.call("/update_weights_from_tensor", body)  # SGLang: only inside a begin/end session
    client.pause_generation()
    client.begin_weight_update()
    try:
        marker = tmp_path / "pwned"
        hostile = base64.b64encode(pickle.dumps([("w", _Shell2(str(marker)))])).decode()
        r = requests.post(f"{server_url}/update_weights_from_tensor", json={"serialized_named_tensors": [hostile]}, timeout=30)
        assert r.status_code == 400 and "refused" in r.json()["message"]
        assert not marker.exists()
        r = requests.post(f"{server_url}/update_weights_from_tensor", json={**body, "load_format": "flattened_bucket"}, timeout=30)
        assert r.status_code == 400 and "load_format" in r.json()["message"]
    finally:
        client.end_weight_update(0)
        client.continue_generation()
    assert client.get_weights_checksum() == before


class _Shell2:
    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


def test_engines_on_another_host_are_refused_by_name(monkeypatch):
    # This host's address toward 10.1.2.3 is 10.1.2.3 itself (one of its own); toward 10.1.2.4 it is not.
    monkeypatch.setattr(weight_transport, "address_toward", lambda host: "10.1.2.3")
    TensorTargets(engines_of(["http://127.0.0.1:31001", "http://10.1.2.3:31002"])).open_sender().close()
    with pytest.raises(RuntimeError, match=r"engine http://10\.1\.2\.4:31002 is on another one; use --update-weight-transfer-mode broadcast"):
        TensorTargets(engines_of(["http://127.0.0.1:31001", "http://10.1.2.4:31002"])).open_sender()


BASE = {"hf_checkpoint": "/m", "prompt_data": "p.jsonl", "rollout_batch_size": 8, "global_batch_size": 8, "num_rollout": 1,
        "update_weight_transfer_mode": "tensor"}  # fmt: skip


@pytest.mark.parametrize(
    "values, fragment",
    [
        ({"rollout_backend": "sglang", "actor_num_gpus_per_node": 8, "rollout_num_gpus": 16, "rollout_num_gpus_per_engine": 16},
         "--rollout-num-gpus-per-engine 16 spans nodes of 8 GPUs (--num-gpus-per-node)"),
        ({"rollout_num_gpus": 2, "actor_num_nodes": 2}, "--num-nodes 2 puts engines on other nodes"),
        ({"rollout_num_gpus": 1, "device": "cuda"}, "(this run has 1 engine(s), not colocated)"),
        ({"rollout_num_gpus": 2, "device": "cuda", "colocate": True, "actor_num_gpus_per_node": 2}, "(this run has 2 engine(s))"),
    ],
)  # fmt: skip
def test_tensor_mode_is_refused_where_handles_cannot_reach_the_engine(values, fragment):
    with pytest.raises(UserError) as e:
        resolve(build_config({**BASE, **values}, environ={}))
    assert fragment in str(e.value) and e.value.option == "--update-weight-transfer-mode"
    assert str(e.value).endswith("broadcast.")


@pytest.mark.parametrize(
    "values",
    [
        {"rollout_num_gpus": 2},  # two built-in engine servers on this CPU host
        {"rollout_backend": "sglang", "colocate": True, "actor_num_gpus_per_node": 4, "rollout_num_gpus_per_engine": 4, "device": "cuda"},
        {},  # the in-process engine takes tensors whatever the mode
    ],
)
def test_tensor_mode_is_accepted_where_it_works(values):
    assert resolve(build_config({**BASE, **values}, environ={})).rollout.update_weight_transfer_mode == "tensor"


def test_the_cli_refuses_it_with_exit_2_and_one_sentence(tmp_path):
    r = subprocess.run(
        [sys.executable, "-m", "miles_cli.main", "train", "--dry-run", "--hf-checkpoint", str(tmp_path), "--prompt-data", "p.jsonl",
         "--rollout-num-gpus", "2", "--num-nodes", "2", "--update-weight-transfer-mode", "tensor"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    out = r.stdout + r.stderr
    assert r.returncode == 2, out[-3000:]
    assert "Traceback" not in out and "--update-weight-transfer-mode tensor hands the trainer's memory" in out
