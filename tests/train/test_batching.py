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
