"""Dynamic-sampling filters: decide whether a finished prompt group is kept for training.

A filter is `fn(args, group: list[Sample]) -> FilterResult` named by `--dynamic-sampling-filter-path`
(e.g. `miles.rollout.filters.check_reward_nonzero_std`). `args` is the `RewardConfig` (its
`reward_key` picks the entry of dict rewards). The rollout keeps generating groups (up to
`--over-sampling-batch-size` in flight) until `--rollout-batch-size` groups are kept; dropped groups
are counted by their `reason` as the metric `rollout/dynamic_filter/drop_<reason>` (upstream miles'
name). Filters shipped here:

- `check_reward_nonzero_std`: keep a group only if its rewards differ (population std > 1e-8): with
  group-normalised advantages (GRPO) a group whose responses all score the same teaches nothing.
  Reason when dropped: `zero_std_<reward rounded to 1 decimal>` (upstream miles' names), e.g.
  `zero_std_1.0`, `zero_std_0.0`, `zero_std_0.5`: a continuous reward (f1) gives at most ~20 distinct
  reasons in [-1, 1], not one per float value.
- `check_no_aborted`: drop a group with any aborted sample. Reason: `group_has_aborted`.

What it is not: the loop that submits and collects groups (the rollout function does that).
"""

from __future__ import annotations

import dataclasses
import statistics
from typing import Any, Callable

from miles.errors import UserError
from miles.sample import Sample, SampleStatus
from miles.utils.load_function import load_function

_MIN_STD = 1e-8


@dataclasses.dataclass(frozen=True)
class FilterResult:
    keep: bool
    reason: str | None = None
    """Why the group was dropped (None when kept); dropped groups are counted per reason."""


GroupFilter = Callable[[Any, list[Sample]], FilterResult]


def check_reward_nonzero_std(args: Any, group: list[Sample]) -> FilterResult:
    reward_key = getattr(args, "reward_key", None)
    rewards = [s.get_reward_value(reward_key) for s in group]
    if len(rewards) > 1 and statistics.pstdev(rewards) > _MIN_STD:
        return FilterResult(keep=True)
    # `+ 0.0` turns round(-0.04, 1) == -0.0 into 0.0, so one reason names one bucket.
    return FilterResult(keep=False, reason=f"zero_std_{round(float(rewards[0]), 1) + 0.0}" if rewards else "zero_std_empty")


def check_no_aborted(args: Any, group: list[Sample]) -> FilterResult:
    if any(s.status == SampleStatus.ABORTED for s in group):
        return FilterResult(keep=False, reason="group_has_aborted")
    return FilterResult(keep=True)


def load_group_filter(path: str | None) -> GroupFilter | None:
    """The filter named by --dynamic-sampling-filter-path, or None when it is not set."""
    fn = load_function(path, flag="--dynamic-sampling-filter-path")
    if fn is not None and not callable(fn):
        raise UserError(
            f"--dynamic-sampling-filter-path {path} names a {type(fn).__name__}, not a function fn(args, group).",
            option="--dynamic-sampling-filter-path",
        )
    return fn


def apply_group_filter(fn: GroupFilter, args: Any, group: list[Sample]) -> FilterResult:
    """Call a filter and check it kept its contract (a user's filter returning a bool is accepted)."""
    result = fn(args, group)
    if isinstance(result, bool):
        return FilterResult(keep=result, reason=None if result else "filtered")
    if not isinstance(result, FilterResult):
        raise UserError(
            f"--dynamic-sampling-filter-path {getattr(fn, '__qualname__', fn)} returned {type(result).__name__}; "
            "make it return miles.rollout.filters.FilterResult(keep, reason).",
            option="--dynamic-sampling-filter-path",
        )
    return result
