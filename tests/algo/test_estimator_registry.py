"""The advantage-estimator registry: one config literal + one `@estimator` function is all it takes."""

from __future__ import annotations

import typing

import pytest
import torch

from algo_hand_checks import close, make_cfg, packed
from miles.algo import advantages
from miles.algo.advantages import ESTIMATORS, NEEDS_VALUES, compute_advantages_and_returns, estimator
from miles.config.algo import AdvantageEstimator


def test_every_configurable_estimator_is_registered_and_nothing_else():
    assert set(typing.get_args(AdvantageEstimator)) == set(ESTIMATORS)
    assert NEEDS_VALUES == {"ppo"}


@pytest.fixture
def doubled_reward():
    """A new estimator defined here, in a test module, as a developer would add one."""

    @estimator("doubled_reward_for_test")
    def doubled(cfg, *, rewards, kl, mask, segments, values):
        adv = 2 * segments.broadcast(rewards) * mask
        return adv, adv + 1

    yield "doubled_reward_for_test"
    ESTIMATORS.pop("doubled_reward_for_test")


def test_an_estimator_registered_outside_miles_is_reachable_by_its_name(doubled_reward):
    cfg = make_cfg()
    cfg.advantage_estimator = doubled_reward
    mask, seg = packed([torch.tensor([1.0, 1.0, 0.0]), torch.tensor([1.0])])
    adv, ret = compute_advantages_and_returns(
        cfg, rewards=torch.tensor([0.5, -1.0]), loss_mask=mask, segments=seg, n_samples_per_prompt=1
    )
    close(adv, [1.0, 1.0, 0.0, -2.0])
    close(ret, [2.0, 2.0, 1.0, -1.0])


def test_registering_a_name_twice_is_refused(doubled_reward):
    with pytest.raises(ValueError, match="registered twice"):
        estimator(doubled_reward)(lambda cfg, **kw: None)


def test_an_unregistered_name_names_itself():
    cfg = make_cfg()
    cfg.advantage_estimator = "no_such_estimator"
    mask, seg = packed([torch.tensor([1.0])])
    with pytest.raises(ValueError, match="no_such_estimator"):
        advantages.compute_advantages_and_returns(cfg, rewards=torch.tensor([1.0]), loss_mask=mask, segments=seg, n_samples_per_prompt=1)
