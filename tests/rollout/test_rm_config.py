"""RewardConfig.check(): the reward flags that cannot work are rejected with the fix.

Run: pytest tests/rollout/test_rm_config.py
"""

from __future__ import annotations

import dataclasses
import types

import pytest

from miles.config.fields import flag_name
from miles.config.reward import KNOWN_RM_TYPES, RewardConfig
from miles.errors import UserError


@pytest.mark.parametrize("rm_type", [None, *KNOWN_RM_TYPES, *(f"boxed_{t}" for t in KNOWN_RM_TYPES)])
def test_every_known_type_passes(rm_type):
    RewardConfig(rm_type=rm_type, rm_url="http://127.0.0.1:1/r", reward_key="score").check()


def test_unknown_type_lists_every_known_type():
    with pytest.raises(UserError) as e:
        RewardConfig(rm_type="boxed_maths").check()
    assert e.value.option == "--rm-type"
    assert "'boxed_maths'" in str(e.value)
    assert all(t in str(e.value) for t in KNOWN_RM_TYPES)


@pytest.mark.parametrize(
    "kwargs, option",
    [
        ({"rm_type": "remote_rm"}, "--rm-url"),
        ({"rm_type": "boxed_remote_rm"}, "--rm-url"),
        ({"rm_type": "dapo"}, "--reward-key"),
        ({"rm_url": "127.0.0.1:8000"}, "--rm-url"),
        ({"rm_timeout": 0.0}, "--rm-timeout"),
        ({"rm_max_retries": -1}, "--rm-max-retries"),
    ],
)
def test_contradictions_name_the_flag(kwargs, option):
    with pytest.raises(UserError) as e:
        RewardConfig(**kwargs).check()
    assert e.value.option == option
    assert option in str(e.value)


def test_custom_rm_path_makes_the_type_needs_moot():
    RewardConfig(rm_type="remote_rm", custom_rm_path="pkg.fn").check()


def test_eval_reward_key_is_derived_from_reward_key():
    field = {f.name: f for f in dataclasses.fields(RewardConfig)}["eval_reward_key"]
    derived = field.metadata["derived"]
    assert derived.text == "equal to --reward-key"
    config = types.SimpleNamespace(reward=RewardConfig(reward_key="score"))
    assert derived.rule(config) == "score"


def test_flag_names_match_upstream():
    names = [flag_name(f) for f in dataclasses.fields(RewardConfig)]
    assert names == [
        "--rm-type", "--math-free-text-fallback",  # (the fallback is ours: upstream has no free-text grading)
        "--reward-key", "--eval-reward-key", "--group-rm", "--rm-url", "--rm-timeout",
        "--rm-max-retries", "--custom-rm-path", "--custom-reward-post-process-path",
        "--custom-convert-samples-to-train-data-path",
    ]  # fmt: skip
    assert all(f.metadata["help"] for f in dataclasses.fields(RewardConfig))
