"""AlgoConfig: upstream names/defaults, the derived eps_clip_high rule, check() contradictions, no torch import."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from algo_hand_checks import make_cfg
from miles.config.algo import AlgoConfig
from miles.config.fields import flag_name
from miles.errors import UserError


def test_defaults_match_upstream():
    c = AlgoConfig()
    assert (c.advantage_estimator, c.eps_clip, c.eps_clip_high, c.eps_clip_c) == ("grpo", 0.2, None, None)
    assert (c.value_clip, c.kl_coef, c.loss_type, c.kl_loss_type) == (0.2, 0.0, "policy_loss", "k1")
    assert (c.gamma, c.lambd, c.tis_clip, c.tis_clip_low, c.entropy_coef) == (1.0, 1.0, 2.0, 0.0, 0.0)
    flags = {flag_name(f) for f in dataclasses.fields(AlgoConfig)}
    assert {"--eps-clip-high", "--disable-grpo-std-normalization", "--custom-tis-function-path", "--use-rollout-logprobs"} <= flags
    assert all(f.metadata["help"] for f in dataclasses.fields(AlgoConfig))


def test_eps_clip_high_default_is_the_declared_rule():
    derived = next(f for f in dataclasses.fields(AlgoConfig) if f.name == "eps_clip_high").metadata["derived"]
    assert derived.text == "equal to --eps-clip"
    assert make_cfg(eps_clip=0.28).eps_clip_high == 0.28
    assert make_cfg(eps_clip=0.2, eps_clip_high=0.28).eps_clip_high == 0.28


def test_valid_configs_pass():
    make_cfg().check(8)
    make_cfg(advantage_estimator="reinforce_plus_plus", normalize_advantages=True, kl_coef=0.01).check(1)
    make_cfg(use_kl_loss=True, kl_loss_coef=0.01, kl_loss_type="low_var_kl", eps_clip_c=3.0).check(4)
    make_cfg(loss_type="custom_loss", custom_loss_function_path="pkg.mod.fn").check(4)


@pytest.mark.parametrize(
    "overrides, flag",
    [
        (dict(kl_coef=0.1, use_kl_loss=True, advantage_estimator="ppo"), "--kl-coef"),
        (dict(kl_coef=0.1, kl_loss_coef=0.1, advantage_estimator="ppo"), "--kl-coef"),
        (dict(kl_coef=0.1), "--kl-coef"),  # grpo ignores reward-level KL
        (dict(kl_loss_coef=0.1), "--kl-loss-coef"),
        (dict(advantage_estimator="reinforce_plus_plus"), "--normalize-advantages"),
        (dict(advantage_estimator="reinforce_plus_plus_baseline"), "--normalize-advantages"),
        (dict(use_rollout_logprobs=True, use_tis=True), "--use-tis"),
        (dict(loss_type="custom_loss"), "--custom-loss-function-path"),
        (dict(custom_loss_function_path="a.b.c"), "--custom-loss-function-path"),
        (dict(eps_clip_c=1.0), "--eps-clip-c"),
        (dict(eps_clip_c=0.5), "--eps-clip-c"),
        (dict(eps_clip=1.5), "--eps-clip"),
        (dict(gamma=1.1), "--gamma"),
        (dict(tis_clip_low=3.0, tis_clip=2.0), "--tis-clip-low"),
        (dict(custom_tis_function_path="a.b.c"), "--custom-tis-function-path"),
        (dict(use_tis=True, custom_tis_function_path="miles.algo.rollout_correction.mis_function"), "--custom-config-path"),
    ],
)
def test_contradictions_are_user_errors_naming_the_flag(overrides, flag):
    with pytest.raises(UserError) as err:
        make_cfg(**overrides).check(4)
    assert err.value.option == flag
    message = str(err.value)
    assert flag in message or flag.lstrip("-") in message
    assert message.count(". ") == 0, "one sentence"


def test_n_samples_per_prompt_must_be_positive():
    with pytest.raises(UserError, match="n-samples-per-prompt"):
        make_cfg().check(0)


def test_config_module_does_not_import_torch():
    code = "import sys, miles.config.algo; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)
