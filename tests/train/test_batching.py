"""How a rollout is cut into optimizer steps, DP shards and micro-batches."""

from __future__ import annotations

import pytest

from miles.train.batching import plan_steps
from miles.errors import UserError


def test_steps_take_consecutive_global_batches_and_ranks_take_contiguous_slices():
    plans = plan_steps(8, global_batch_size=4, num_steps=2, micro_batch_size=3, dp_rank=1, dp_world_size=2)
    assert [p.global_indices for p in plans] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert [p.micro_batches for p in plans] == [[[2, 3]], [[6, 7]]]


def test_micro_batches_cover_the_shard_with_a_smaller_last_one():
    (plan,) = plan_steps(5, global_batch_size=None, num_steps=1, micro_batch_size=2)
    assert plan.micro_batches == [[0, 1], [2, 3], [4]]
    assert plan.local_indices == [0, 1, 2, 3, 4]


def test_ranks_partition_every_step():
    plans = [plan_steps(12, global_batch_size=6, num_steps=2, micro_batch_size=1, dp_rank=r, dp_world_size=3) for r in range(3)]
    for s in range(2):
        covered = sorted(i for r in range(3) for i in plans[r][s].local_indices)
        assert covered == plans[0][s].global_indices


@pytest.mark.parametrize(
    "kwargs, flag",
    [
        (dict(global_batch_size=3, num_steps=2), "--global-batch-size"),  # 6 != 8 samples
        (dict(global_batch_size=4, num_steps=2, dp_world_size=3), "--global-batch-size"),
        (dict(global_batch_size=8, num_steps=0), "--num-steps-per-rollout"),
    ],
)
def test_inconsistent_sizes_are_user_errors(kwargs, flag):
    with pytest.raises(UserError, match=flag):
        plan_steps(8, micro_batch_size=1, **kwargs)


# --- token budget (--use-dynamic-batch-size --max-tokens-per-gpu) ---------------------------------


def _budget_plans(lengths, *, dp, gbs, budget, steps=1):
    return [plan_steps(len(lengths), global_batch_size=gbs, num_steps=steps, micro_batch_size=1, dp_rank=r,
                       dp_world_size=dp, lengths=lengths, max_tokens_per_gpu=budget) for r in range(dp)]


def test_token_budget_by_hand():
    # 8 samples over 2 ranks, 4 each, longest first to the rank with fewer tokens (ties: rank 0):
    # rank 0 gets 9, 6, 3, 1 (19 tokens), rank 1 gets 8, 7, 2, 1 (18). Budget 10: two micro-batches
    # each, longest first again: [9, 1] [6, 3] and [8, 1] [7, 2].
    lengths = [9, 1, 8, 2, 7, 3, 6, 1]
    r0, r1 = (p[0].micro_batches for p in _budget_plans(lengths, dp=2, gbs=8, budget=10))
    assert r0 == [[0, 7], [5, 6]] and r1 == [[1, 2], [3, 4]]
    assert [sum(lengths[i] for mb in r for i in mb) for r in (r0, r1)] == [19, 18]


def test_token_budget_plans_cover_every_sample_once_within_budget_with_equal_counts():
    import random

    rng = random.Random(0)
    for _ in range(300):
        dp = rng.choice([1, 2, 3, 4])
        gbs, steps = dp * rng.randint(1, 6), rng.randint(1, 3)
        lengths = [rng.randint(1, 40) for _ in range(gbs * steps)]
        budget = rng.randint(5, 60)
        plans = _budget_plans(lengths, dp=dp, gbs=gbs, budget=budget, steps=steps)
        for s in range(steps):
            covered = sorted(i for r in range(dp) for i in plans[r][s].local_indices)
            assert covered == plans[0][s].global_indices  # none dropped, none twice
            assert len({len(plans[r][s].micro_batches) for r in range(dp)}) == 1  # FSDP: one reduce-scatter each
            assert len({len(plans[r][s].local_indices) for r in range(dp)}) == 1
            for r in range(dp):
                for mb in plans[r][s].micro_batches:
                    assert mb and (len(mb) == 1 or sum(lengths[i] for i in mb) <= budget), (mb, budget)


def test_token_budget_balances_ranks_where_contiguous_slices_do_not():
    lengths = [40, 40, 40, 40, 2, 2, 2, 2]  # contiguous halves: 160 vs 8 tokens
    per_rank = [sum(lengths[i] for i in p[0].local_indices) for p in _budget_plans(lengths, dp=2, gbs=8, budget=100)]
    assert per_rank == [84, 84]


def test_a_sample_longer_than_the_budget_trains_alone():
    (plan,) = _budget_plans([50, 3, 4, 5], dp=1, gbs=4, budget=10)[0]
    assert plan.micro_batches == [[0], [1, 2], [3]]  # 12 tokens under a budget of 10: two, after the long one
