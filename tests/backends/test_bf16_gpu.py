"""GPU-only `--bf16` checks for the torch backend (skipped without CUDA; `scripts/gpu_smoke.sh` runs
`tests/backends -m gpu`): one training step on the GPU with one worker (autocast) and with FSDP2
(MixedPrecisionPolicy over a one-rank NCCL group) computes in bf16 from fp32 parameters, trains to
finite numbers, and hands bf16-engine weights over as bf16 CUDA tensors; offload then frees the
parameters and optimizer state from the GPU (torch.cuda.memory_allocated before/after).

Unverified on the CPU-only build machine: these have never run there."""

from __future__ import annotations

import math

import pytest
import torch
from backend_fixtures import make_engine_cfg, make_train_data

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("backend", ["torch", "fsdp"])
def test_bf16_step_on_the_gpu(tiny_hf_dir, backend):
    from miles.backends.torch import TorchBackend
    from miles.train.step import train_rollout

    cfg = make_engine_cfg(tiny_hf_dir, micro_batch_size=4)
    cfg.train.bf16, cfg.train.train_backend, cfg.rollout.rollout_dtype = True, backend, "bfloat16"
    trainer = TorchBackend(cfg, rank=0, world_size=1, device="cuda")
    seen: set[torch.dtype] = set()
    for m in trainer.model.modules():
        if isinstance(m, torch.nn.Linear):
            m.register_forward_hook(lambda _m, _i, out: seen.add(out.dtype))
    metrics = train_rollout(trainer, make_train_data(8, seed=1), rollout_id=0)
    assert seen == {torch.bfloat16}
    assert math.isfinite(metrics["train/loss"]) and metrics["train/grad_norm"] > 0
    assert all(p.dtype == torch.float32 and p.device.type == "cuda" for p in trainer.model.parameters())
    sent = [t for bucket in trainer.iter_weight_buckets(1 << 20) for _, t in bucket]
    assert sent and all(t.dtype == torch.bfloat16 and t.is_cuda for t in sent)

    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    trainer.offload()
    torch.cuda.synchronize()
    after = torch.cuda.memory_allocated()
    held = sum(p.numel() * 4 for p in trainer.model.parameters())  # fp32 weights at least (plus Adam's 2x)
    assert before - after >= held, (before, after, held)
    trainer.onload()
    train_rollout(trainer, make_train_data(8, seed=2), rollout_id=1)
