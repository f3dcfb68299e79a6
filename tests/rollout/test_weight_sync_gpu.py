"""GPU-only weight-sync checks (skipped without CUDA; `scripts/gpu_smoke.sh` runs them first on a GPU):
a tensor (CUDA IPC) sync into a built-in engine server in another process on the same GPU, a
broadcast over NCCL with no host copy (two GPUs), and a memory release that frees the engine's GPU.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from miles.prepare.tiny_model import create_tiny_qwen3
from miles.rollout.engine.base import weights_checksum
from miles.rollout.engine.http_client import HttpEngine
from miles.rollout.engine.weight_transport import BroadcastTargets, TensorTargets, engines_of

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> str:
    return str(create_tiny_qwen3(tmp_path_factory.mktemp("gpu") / "hf", seed=0))


def _server(hf_dir: str, gpu: int):
    env = {**__import__("os").environ, "CUDA_VISIBLE_DEVICES": str(gpu)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "miles.rollout.engine.server", "--hf-checkpoint", hf_dir, "--port", "0", "--device", "cuda"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    url = proc.stdout.readline().strip()
    assert url.startswith("http://127.0.0.1:"), proc.stderr.read() if proc.poll() is not None else url
    return proc, url


def _weights(hf_dir: str, device: str) -> list[tuple[str, torch.Tensor]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir)
    g = torch.Generator().manual_seed(5)
    return [(n, (p.detach() + 0.01 * torch.randn(p.shape, generator=g)).to(device)) for n, p in model.named_parameters()]


def _sync(sender, client, named, version):
    client.pause_generation()
    client.begin_weight_update()
    sender.begin(version)
    for bucket in (named[:5], named[5:]):
        sender.send_bucket(bucket, version)
    sender.finish(version)
    client.end_weight_update(version)
    client.continue_generation()


def test_tensor_sync_by_cuda_ipc_reaches_another_process_bit_exact(hf_dir):
    proc, url = _server(hf_dir, 0)
    try:
        named = _weights(hf_dir, "cuda:0")
        client = HttpEngine(url)
        sender = TensorTargets(engines_of([url])).open_sender()
        _sync(sender, client, named, 3)
        sender.close()
        assert client.get_weights_checksum() == weights_checksum([(n, t.cpu()) for n, t in named])
    finally:
        proc.terminate()
        proc.wait(30)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL refuses two ranks on one GPU: needs 2 GPUs")
def test_broadcast_of_cuda_weights_runs_over_nccl_bit_exact(hf_dir):
    proc, url = _server(hf_dir, 1)
    try:
        named = _weights(hf_dir, "cuda:0")
        client = HttpEngine(url)
        sender = BroadcastTargets(engines_of([url])).open_sender()
        _sync(sender, client, named, 4)
        assert sender.backend == "nccl"
        sender.close()
        assert client.get_weights_checksum() == weights_checksum([(n, t.cpu()) for n, t in named])
    finally:
        proc.terminate()
        proc.wait(30)


def test_releasing_the_weights_frees_the_engines_gpu_memory(hf_dir):
    from miles.rollout.engine.builtin import BuiltinEngine

    engine = BuiltinEngine(hf_dir, device="cuda")
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    engine.release_memory_occupation(["kv_cache"])
    assert torch.cuda.memory_allocated() == before  # the weights stay
    engine.release_memory_occupation(["weights"])
    assert torch.cuda.memory_allocated() < before
    engine.resume_memory_occupation(["weights"])
    assert torch.cuda.memory_allocated() >= before - 1024
