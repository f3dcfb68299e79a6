"""`--bf16` on the torch backend (one worker and FSDP2 over a one-rank group): the matmuls run in
bf16 while parameters, gradients and AdamW state stay fp32; the gradients are the fp32 gradients to
bf16 rounding (and not bit-equal to them: bf16 really ran); the fp32 default is untouched; weights
travel to the engines in the engine's dtype."""

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
from miles.config.algo import AlgoConfig
from miles.train.step import train_rollout


def _trainer(hf_dir, *, bf16: bool, backend: str = "torch", rollout_dtype: str = "float32", **kw) -> TorchBackend:
    cfg = make_engine_cfg(hf_dir, micro_batch_size=4, clip_grad=0.0, **kw)
    cfg.train.bf16, cfg.train.train_backend, cfg.rollout.rollout_dtype = bf16, backend, rollout_dtype
    return TorchBackend(cfg, rank=0, world_size=1, device="cpu")


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _grads(trainer: TorchBackend) -> dict[str, torch.Tensor]:
    return {n: _local(p.grad).detach().clone() for n, p in trainer.model.named_parameters()}


def _matmul_dtypes(trainer: TorchBackend, data: dict) -> set[torch.dtype]:
    """The output dtypes of every nn.Linear during one training step."""
    seen: set[torch.dtype] = set()
    hooks = [m.register_forward_hook(lambda _m, _i, out: seen.add(out.dtype))
             for m in trainer.model.modules() if isinstance(m, torch.nn.Linear)]
    try:
        train_rollout(trainer, data, rollout_id=0)
    finally:
        for h in hooks:
            h.remove()
    return seen


@pytest.mark.parametrize("backend", ["torch", "fsdp"])
def test_bf16_computes_in_bf16_with_fp32_master_weights_grads_and_adam_state(tiny_hf_dir, backend):
    data = make_train_data(8, seed=1)
    fp32 = _trainer(tiny_hf_dir, bf16=False, backend=backend)
    bf16 = _trainer(tiny_hf_dir, bf16=True, backend=backend)
    assert _matmul_dtypes(fp32, data) == {torch.float32}
    assert _matmul_dtypes(bf16, data) == {torch.bfloat16}
    for p in bf16.model.parameters():
        assert _local(p).dtype == torch.float32 and _local(p.grad).dtype == torch.float32
    for state in bf16.optimizer.state.values():
        assert _local(state["exp_avg"]).dtype == _local(state["exp_avg_sq"]).dtype == torch.float32


@pytest.mark.parametrize("backend", ["torch", "fsdp"])
def test_bf16_gradients_are_the_fp32_gradients_to_bf16_rounding(tiny_hf_dir, backend):
    data = make_train_data(8, seed=2)
    g32, g16 = [], []
    for bf16, out in ((False, g32), (True, g16)):
        trainer = _trainer(tiny_hf_dir, bf16=bf16, backend=backend)
        train_rollout(trainer, data, rollout_id=0)
        out.append(_grads(trainer))
    a, b = g32[0], g16[0]
    flat_a = torch.cat([a[k].flatten() for k in a])
    flat_b = torch.cat([b[k].flatten() for k in a])
    rel = float((flat_a - flat_b).norm() / flat_a.norm())
    # bf16 keeps 8 mantissa bits (relative rounding 2^-9 per op); a few layers of it stay within 5%.
    assert 0 < rel < 5e-2, rel


def test_bf16_sft_loss_decreases_like_fp32(tiny_hf_dir):
    data = make_train_data(8, seed=5)
    sft = AlgoConfig(loss_type="sft_loss", eps_clip_high=0.2)
    runs = {}
    for bf16 in (False, True):
        trainer = _trainer(tiny_hf_dir, bf16=bf16, algo=sft, lr=1e-2)
        runs[bf16] = [train_rollout(trainer, data, rollout_id=i)["train/loss"] for i in range(15)]
    assert runs[True][-1] < 0.6 * runs[True][0], runs[True]
    assert runs[True][-1] == pytest.approx(runs[False][-1], rel=0.1), runs


@pytest.mark.parametrize("rollout_dtype", ["float32", "bfloat16"])
def test_weights_travel_in_the_engine_dtype(tiny_hf_dir, rollout_dtype):
    from miles.utils.weights import weights_checksum

    trainer = _trainer(tiny_hf_dir, bf16=True, rollout_dtype=rollout_dtype)
    train_rollout(trainer, make_train_data(4, seed=3), rollout_id=0)
    sent = [(n, t) for bucket in trainer.iter_weight_buckets(1 << 20) for n, t in bucket]
    want = getattr(torch, rollout_dtype)
    assert sent and {t.dtype for _, t in sent} == {want}
    master = dict(trainer.named_weights_for_sync())
    assert all(torch.equal(t, master[n].to(want)) for n, t in sent)
    # --check-weight-update-equal compares the engine's weights with what was sent.
    assert trainer.weights_checksum() == weights_checksum(sent)
    if rollout_dtype == "float32":  # the fp32 path sends the live fp32 weights themselves, no copy
        assert all(t.data_ptr() == master[n].data_ptr() for n, t in sent)


def test_engine_dtype_follows_the_engine_and_sglangs_auto_rule(tmp_path):
    import json

    from miles.backends.precision import engine_dtype
    from miles.config.engine import EngineConfig

    cfg = EngineConfig()
    assert engine_dtype(cfg) == torch.float32
    cfg.rollout.rollout_dtype = "bfloat16"
    assert engine_dtype(cfg) == torch.bfloat16
    cfg.rollout.rollout_backend = "sglang"
    cfg.rollout.hf_checkpoint = str(tmp_path)
    for saved, want in (("bfloat16", torch.bfloat16), ("float32", torch.float16)):
        (tmp_path / "config.json").write_text(json.dumps({"dtype": saved}))
        assert engine_dtype(cfg) == want, saved
    cfg.sglang.sglang_dtype = "float32"
    assert engine_dtype(cfg) == torch.float32
