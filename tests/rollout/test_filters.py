"""Dynamic-sampling filters: verdicts and reasons on hand-made groups, and loading by flag.

Run: pytest tests/rollout/test_filters.py
"""

from __future__ import annotations

import pytest

from miles.config.reward import RewardConfig
from miles.errors import UserError
from miles.rollout.filters import (
    FilterResult,
    apply_group_filter,
    check_no_aborted,
    check_reward_nonzero_std,
    load_group_filter,
)
from miles.sample import Sample, SampleStatus


def group(*rewards, status=SampleStatus.COMPLETED) -> list[Sample]:
    return [Sample(reward=r, status=status) for r in rewards]


@pytest.mark.parametrize(
    "rewards, expected",
    [
        ((1.0, 0.0, 1.0, 1.0), FilterResult(True)),
        ((1.0, 1.0, 1.0, 1.0), FilterResult(False, "zero_std_1.0")),
        ((0.0, 0.0), FilterResult(False, "zero_std_0.0")),
        ((0.5, 0.5, 0.5), FilterResult(False, "zero_std_0.5")),
        ((-1.0, -1.0), FilterResult(False, "zero_std_-1.0")),
        ((1.0,), FilterResult(False, "zero_std_1.0")),  # one sample has no spread (n_samples_per_prompt == 1)
        # continuous rewards (f1) are rounded to one decimal, as upstream does: one reason per bucket
        ((0.4231, 0.4231), FilterResult(False, "zero_std_0.4")),
        ((0.4449, 0.4449), FilterResult(False, "zero_std_0.4")),
        ((0.66666, 0.66666), FilterResult(False, "zero_std_0.7")),
        ((-0.04, -0.04), FilterResult(False, "zero_std_0.0")),  # not "-0.0"
        ((0.3, 0.3 + 1e-9), FilterResult(False, "zero_std_0.3")),  # std 5e-10 is below the 1e-8 threshold
        ((0.3, 0.3 + 1e-7), FilterResult(True)),  # std 5e-8 is above it
    ],
)
def test_check_reward_nonzero_std(rewards, expected):
    assert check_reward_nonzero_std(RewardConfig(), group(*rewards)) == expected


def test_nonzero_std_uses_reward_key_for_dict_rewards():
    g = [Sample(reward={"score": 1.0, "acc": True}), Sample(reward={"score": -1.0, "acc": False})]
    assert check_reward_nonzero_std(RewardConfig(reward_key="score"), g).keep
    same = [Sample(reward={"score": 1.0, "acc": True}), Sample(reward={"score": 1.0, "acc": False})]
    assert check_reward_nonzero_std(RewardConfig(reward_key="score"), same) == FilterResult(False, "zero_std_1.0")


def test_check_no_aborted():
    assert check_no_aborted(None, group(1.0, 0.0)) == FilterResult(True)
    g = group(1.0, 0.0)
    g[1].status = SampleStatus.ABORTED
    assert check_no_aborted(None, g) == FilterResult(False, "group_has_aborted")
    assert check_no_aborted(None, group(1.0, status=SampleStatus.TRUNCATED)).keep  # truncated is a real response


def test_load_by_flag_value():
    fn = load_group_filter("miles.rollout.filters.check_reward_nonzero_std")
    assert fn is check_reward_nonzero_std
    assert load_group_filter(None) is None
    with pytest.raises(UserError, match="--dynamic-sampling-filter-path"):
        load_group_filter("miles.rollout.filters.no_such_filter")
    with pytest.raises(UserError, match="not a function"):
        load_group_filter("miles.rollout.filters._MIN_STD")


def test_apply_checks_the_contract():
    assert apply_group_filter(lambda args, g: False, None, []) == FilterResult(False, "filtered")
    assert apply_group_filter(lambda args, g: True, None, []) == FilterResult(True)
    with pytest.raises(UserError, match="FilterResult"):
        apply_group_filter(lambda args, g: "keep", None, [])
