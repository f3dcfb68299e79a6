"""--num-epoch counts steps of --rollout-batch-size groups, not of --over-sampling-batch-size draws."""

from __future__ import annotations

import pytest

from miles.config.data import rollouts_for_epochs


@pytest.mark.parametrize(
    "num_prompts, num_epoch, rollout_batch_size, expected",
    [
        (100, 1, 8, 12),  # 100 // 8 = 12 full steps per epoch
        (100, 2, 8, 24),  # per-epoch steps, times epochs (not 200 // 8 = 25)
        (25, 1, 4, 6),
        (3, 1, 4, 1),  # fewer prompts than one step: still one step
    ],
)
def test_rollouts_for_epochs_hand_numbers(num_prompts, num_epoch, rollout_batch_size, expected):
    assert rollouts_for_epochs(num_prompts, num_epoch, rollout_batch_size) == expected
