"""`--recompute-granularity full` on the torch backends (Hugging Face gradient checkpointing of every
decoder layer): the decoder layers really run twice per training step, and the gradients equal those
of storing the activations (same kernels, no dropout: within 1e-6)."""

from __future__ import annotations

import pytest
import torch
from backend_fixtures import make_engine_cfg, make_train_data

from miles.backends.torch import TorchBackend


@pytest.fixture(autouse=True)
def _no_leftover_process_group():
    """An in-process FSDP trainer creates a one-rank process group; other tests expect none."""
    import torch.distributed as dist

    had = dist.is_initialized()
    yield
    if dist.is_initialized() and not had:
        dist.destroy_process_group()
from miles.train.step import train_rollout


def _run(hf_dir, *, backend: str, recompute: bool):
    from torch.distributed.tensor import DTensor

    cfg = make_engine_cfg(hf_dir, micro_batch_size=4, clip_grad=0.0)
    cfg.train.train_backend = backend
    cfg.train.recompute_granularity = "full" if recompute else None
    trainer = TorchBackend(cfg, rank=0, world_size=1, device="cpu")
    # Counted by the activation's own forward: module hooks do not fire during a checkpoint's recompute.
    act = trainer.model.model.layers[0].mlp.act_fn
    calls, real = [], act.forward
    act.forward = lambda x: (calls.append(torch.is_grad_enabled()), real(x))[1]
    train_rollout(trainer, make_train_data(8, seed=4), rollout_id=0)
    local = lambda t: t.to_local() if isinstance(t, DTensor) else t  # noqa: E731
    return {n: local(p.grad).clone() for n, p in trainer.model.named_parameters()}, calls


@pytest.mark.parametrize("backend", ["torch", "fsdp"])
def test_recompute_equals_storing_activations(tiny_hf_dir, backend):
    stored, calls_stored = _run(tiny_hf_dir, backend=backend, recompute=False)
    recomputed, calls_recomputed = _run(tiny_hf_dir, backend=backend, recompute=True)
    # One forward per micro-batch (2) without recompute; with it, each one runs again in backward.
    assert len(calls_recomputed) == 2 * len(calls_stored), (calls_stored, calls_recomputed)
    worst = max((stored[k] - recomputed[k]).abs().max().item() for k in stored)
    assert worst <= 1e-6, worst
    assert max(g.abs().max().item() for g in stored.values()) > 1e-4


def test_selective_recompute_is_refused_on_the_torch_backend():
    from miles.config.resolve import build_config, resolve
    from miles.errors import UserError

    with pytest.raises(UserError, match="--recompute-granularity selective applies only to --train-backend megatron"):
        resolve(build_config({"prompt_data": "p.jsonl", "recompute_granularity": "selective"}, environ={}))
