"""`--use-dynamic-batch-size --max-tokens-per-gpu N` on the torch backend: micro-batches cut by a token
budget give the gradients of fixed micro-batches (the cut changes nothing but rounding), and the
comparison sees a token dropped or counted twice. Over two DDP ranks (gloo), the length-balanced
shards train like one process."""

from __future__ import annotations

import pytest
import torch
from backend_fixtures import make_engine_cfg, make_train_data

from miles.backends.torch import TorchBackend
from miles.config.algo import AlgoConfig
from miles.train import batching
from miles.train.step import train_rollout


def _trainer(hf_dir, *, budget: int | None, per_token: bool = False) -> TorchBackend:
    cfg = make_engine_cfg(hf_dir, micro_batch_size=3, clip_grad=0.0,
                          algo=AlgoConfig(eps_clip_high=0.2, calculate_per_token_loss=per_token))
    cfg.train.use_dynamic_batch_size = budget is not None
    cfg.train.max_tokens_per_gpu = budget
    return TorchBackend(cfg, rank=0, world_size=1, device="cpu")


def _grads(trainer: TorchBackend) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in trainer.model.named_parameters()}


def _worst(a: dict, b: dict) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.mark.parametrize("per_token", [False, True])
def test_token_budget_micro_batches_give_the_fixed_micro_batch_gradients(tiny_hf_dir, per_token, monkeypatch):
    data = make_train_data(12, seed=7)
    fixed = _trainer(tiny_hf_dir, budget=None, per_token=per_token)
    m_fixed = train_rollout(fixed, data, rollout_id=0)
    cuts = []
    real = batching.cut_by_tokens
    monkeypatch.setattr(batching, "cut_by_tokens", lambda *a, **k: cuts.append(real(*a, **k)) or cuts[-1])
    budget = _trainer(tiny_hf_dir, budget=20, per_token=per_token)
    m_budget = train_rollout(budget, data, rollout_id=0)
    assert len(cuts[0][0]) > 4 and cuts[0][0] != [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10, 11]]  # a real, different cut
    g_fixed, g_budget = _grads(fixed), _grads(budget)
    assert _worst(g_fixed, g_budget) <= 1e-6
    assert m_budget["train/loss"] == pytest.approx(m_fixed["train/loss"], rel=1e-5, abs=1e-7)

    # The same comparison is red when the plan drops a sample or trains one twice.
    for broken in ("drop", "twice"):
        def bad(*a, **k):
            plan = real(*a, **k)
            plan[0][0] = plan[0][0][1:] if broken == "drop" else plan[0][0] + [plan[0][-1][0]]
            return plan

        monkeypatch.setattr(batching, "cut_by_tokens", bad)
        wrong = _trainer(tiny_hf_dir, budget=20, per_token=per_token)
        train_rollout(wrong, data, rollout_id=0)
        assert _worst(g_fixed, _grads(wrong)) > 1e-4, broken


@pytest.mark.slow  # one process and two spawned ranks, about 1-2.5 minutes on 2 busy cores
def test_two_fsdp_ranks_with_token_budget_shards_train_like_one_process(tiny_hf_dir, tmp_path):
    """FSDP2 over two gloo ranks, each given its length-balanced shard in micro-batches of at most 16
    tokens (a different count of samples per micro-batch on each rank, the same count of micro-batches:
    FSDP reduce-scatters after each one, so unequal counts would hang): the per-step losses and
    gradient norms are those of one process with fixed micro-batches of 2 samples."""
    import json

    from dp_worker import spawn, train_reference_rollouts

    _, ref_losses, ref_norms = train_reference_rollouts(tiny_hf_dir)
    spawn(2, tiny_hf_dir, str(tmp_path), train_backend="fsdp", max_tokens_per_gpu=16, resume=False)
    losses = json.loads((tmp_path / "straight" / "losses.json").read_text())
    norms = json.loads((tmp_path / "straight" / "grad_norms.json").read_text())
    assert losses == pytest.approx(ref_losses, abs=1e-5, rel=0), (ref_losses, losses)
    assert norms == pytest.approx(ref_norms, rel=1e-5), (ref_norms, norms)
