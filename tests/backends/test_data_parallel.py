"""Data parallel with torch DDP over gloo: two ranks on the same global batches train like one
process, and a per-rank checkpoint taken half way resumes bit for bit."""

from __future__ import annotations

import json

import pytest
import torch
from dp_worker import full_weights, spawn, train_reference_rollouts


def _results(run_dir):
    weights = torch.load(run_dir / "weights.pt", weights_only=True)
    losses = json.loads((run_dir / "losses.json").read_text())
    rngs = [json.loads((run_dir / f"rank{r}_rng.json").read_text()) for r in range(2)]
    return weights, losses, rngs


@pytest.fixture(scope="module")
def dp2(tiny_hf_dir, tmp_path_factory):
    """Two gloo ranks (spawned once): a straight run and a run resumed from a per-rank checkpoint."""
    out_dir = tmp_path_factory.mktemp("dp2")
    spawn(2, tiny_hf_dir, str(out_dir))
    return out_dir


@pytest.fixture(scope="module")
def dp1(tiny_hf_dir):
    trainer, losses, _ = train_reference_rollouts(tiny_hf_dir)
    return full_weights(trainer), losses


def test_two_ranks_equal_one_process(dp1, dp2):
    dp2_weights, dp2_losses, _ = _results(dp2 / "straight")
    dp1_weights, dp1_losses = dp1
    # per-step losses within 1e-5 (whitening uses the statistics of the whole DP group; per-rank
    # statistics would move them by ~1e-2)
    assert dp2_losses == pytest.approx(dp1_losses, abs=1e-5, rel=0), (dp1_losses, dp2_losses)
    worst = max((dp2_weights[k] - dp1_weights[k]).abs().max().item() for k in dp1_weights)
    assert worst <= 1e-5, worst


def test_two_rank_per_rank_checkpoint_resume_is_bit_exact(dp2):
    resumed = dp2 / "resumed"
    s_weights, s_losses, s_rngs = _results(dp2 / "straight")
    r_weights, r_losses, r_rngs = _results(resumed)
    # one file per rank: every rank wrote its own shard (and its own RNG state)
    assert sorted(p.name for p in (resumed / "ckpt").glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    assert r_losses == s_losses
    assert all(torch.equal(r_weights[k], s_weights[k]) for k in s_weights)
    assert r_rngs == s_rngs  # both ranks' generators continue where they were
