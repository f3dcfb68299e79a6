"""GPU-only checks of the megatron backend (skipped without CUDA; `scripts/gpu_smoke.sh` runs them):

- one GPU, --bf16 with the distributed optimizer: the model is on the GPU, trains to finite numbers
  that follow the CPU torch reference, hands weights over as CUDA tensors, and --offload-train's
  release frees the GPU memory of parameters, gradient buffers and optimizer state (measured with
  torch.cuda.memory_allocated) and brings it back so that training continues as if never offloaded;
- two GPUs over NCCL: PP=2 (log-prob broadcast between stages, metric reduction and broadcast,
  weight gathers from both stages) and DP=2 with the distributed optimizer (DP metric and advantage
  reductions) match the CPU torch reference;
- with TransformerEngine (--transformer-impl transformer_engine, --bf16): packed micro-batches go to TE
  with PackedSeqParams (thd, the samples' cu_seqlens) and score every sample as padded rows do; without
  them TE's causal mask would let each sample attend to the ones packed before it.

Unverified on the CPU-only build machine: these have never run there."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

import _mg_workers as _mp  # noqa: E402
from test_megatron_trainer import ROLLOUTS, _config, _losses, _ref_log_probs, _reference  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> str:
    from miles.prepare.tiny_model import create_tiny_qwen3

    return str(create_tiny_qwen3(tmp_path_factory.mktemp("tiny") / "hf", seed=0))


def _assert_follows_reference(hf: str, config: dict, result: dict, *, tol: float) -> None:
    """GPU fp32 against the CPU torch reference: the same math, different kernels (so a tolerance)."""
    from _mg_reference import TorchReference

    from miles.config.resolve import build_config, fill_derived

    ref_config = {**config, "bf16": False}
    lp, _ = _ref_log_probs(TorchReference(hf, fill_derived(build_config(ref_config))))
    assert (result["initial_log_probs"] - lp).abs().max() <= tol
    ref_losses, _ = _reference(hf, ref_config)
    assert max(abs(a - b) for a, b in zip(_losses(result), ref_losses)) <= tol, (_losses(result), ref_losses)


def test_bf16_step_on_one_gpu_and_offload_frees_its_memory(hf_dir, tmp_path):
    config = {**_config(hf_dir, world=1, dist_opt=True), "bf16": True}
    plain = _mp.run(1, {"config": config, "rollouts": ROLLOUTS, "log_probs_seed": 5, "device": "cuda"}, tmp_path)
    assert plain["devices"] == ["cuda"] and plain["bucket_devices"] == ["cuda"]
    assert plain["dtypes"] == {"params": {"torch.bfloat16"}, "grads": {"torch.float32"},
                               "main_params": {"torch.float32"}, "adam": {"torch.float32"}}, plain["dtypes"]
    assert all(math.isfinite(m["train/loss"]) and m["train/grad_norm"] > 0 for m in plain["metrics"])
    # bf16 compute: near the fp32 reference, not equal to it (as on CPU: test_megatron_trainer.py)
    _assert_follows_reference(hf_dir, config, plain, tol=0.1)

    offloaded = _mp.run(1, {"config": config, "rollouts": ROLLOUTS, "device": "cuda", "offload_each_rollout": True}, tmp_path)
    n = offloaded["num_params"]
    for (held, freed, after), (before, during) in zip(offloaded["offload"], offloaded["cuda_allocated"]):
        assert freed == held >= 18 * n and after == 0, (held, freed, after)  # bf16 2 + grad 4 + main 4 + Adam 8
        assert before - during >= 18 * n, (before, during, 18 * n)  # really given back to the allocator
    # Same kernels on the same inputs: the restored state trains on as if never offloaded.
    assert max(abs(a - b) for a, b in zip(_losses(offloaded), _losses(plain))) <= 1e-6
    assert offloaded["checksum"] == plain["checksum"]


@two_gpus
@pytest.mark.parametrize("layout", [dict(pp=2), dict(dist_opt=True), dict(tp=2)],
                         ids=["pp2", "dp2-distributed-optimizer", "tp2-vocab-parallel-log-probs"])
def test_two_gpus_over_nccl_match_the_torch_reference(hf_dir, tmp_path, layout):
    config = _config(hf_dir, world=2, **layout)
    result = _mp.run(2, {"config": config, "rollouts": ROLLOUTS, "log_probs_seed": 5, "device": "cuda"}, tmp_path)
    _assert_follows_reference(hf_dir, config, result, tol=1e-4)
    assert result["per_rank"][0][0] == result["per_rank"][1][0]  # both ranks agree on the full weights


@pytest.mark.skipif(importlib.util.find_spec("transformer_engine") is None, reason="needs TransformerEngine")
def test_transformer_engine_packed_samples_attend_only_to_themselves(hf_dir, tmp_path):
    """4 samples of different lengths in one packed micro-batch (thd + cu_seqlens) against the same 4 as
    right-padded rows (TE's plain causal attention, where padding is never seen): the same log-probs and
    entropies up to bf16 kernels, and a training rollout to the same loss. Red if PackedSeqParams are
    dropped (every sample but the first would see its predecessors)."""
    config = {**_config(hf_dir, world=1), "bf16": True, "transformer_impl": "transformer_engine"}
    runs = {}
    for layout in ("packed", "padded"):
        (tmp_path / layout).mkdir()
        runs[layout] = _mp.run(1, {"config": config, "rollouts": [0], "log_probs_seed": 5, "device": "cuda", "layout": layout},
                               tmp_path / layout)
    packed, padded = runs["packed"], runs["padded"]
    assert (packed["initial_log_probs"] - padded["initial_log_probs"]).abs().max() <= 0.05
    assert (packed["initial_entropy"] - padded["initial_entropy"]).abs().max() <= 0.05
    assert abs(_losses(packed)[0] - _losses(padded)[0]) <= 0.05
