"""The hand-number checks catch real bugs: swap in a deliberately wrong implementation and the same
check must fail. If one of these tests fails, a check has gone blind to the bug it names."""

from __future__ import annotations

import pytest
import torch

import algo_hand_checks as checks
from miles.algo import advantages, kl, losses, reduce
from miles.rollout import train_data

_right_normalize = advantages.normalize_group_rewards
_right_kl = kl.approx_kl
_right_surrogate = losses.clipped_surrogate
_right_gae = advantages.gae


def _assert_check_fails(check) -> None:
    with pytest.raises(AssertionError):
        check()


def test_missing_std_normalisation_is_caught(monkeypatch):
    def no_std(rewards, n, **kw):
        return _right_normalize(rewards, n, **{**kw, "std_normalization": False})

    monkeypatch.setattr(advantages, "normalize_group_rewards", no_std)
    monkeypatch.setattr(train_data, "normalize_group_rewards", no_std)
    _assert_check_fails(checks.check_group_normalization)
    _assert_check_fails(checks.check_train_data_rewards)


def test_population_std_instead_of_bessel_is_caught(monkeypatch):
    def population_std(rewards, n, *, subtract_mean=True, std_normalization=True, eps=1e-6):
        g = rewards.reshape(-1, n)
        g = g - g.mean(-1, keepdim=True)
        return (g / (g.std(-1, keepdim=True, correction=0) + eps)).reshape(-1)

    monkeypatch.setattr(advantages, "normalize_group_rewards", population_std)
    _assert_check_fails(checks.check_group_normalization)


def test_clip_on_the_wrong_side_is_caught(monkeypatch):
    def pessimism_flipped(ppo_kl, adv, **kw):
        # min instead of max: the clip now helps the objective instead of limiting it
        loss, clip, ratio = _right_surrogate(ppo_kl, adv, **kw)
        r = (-ppo_kl).exp()
        return torch.minimum(-r * adv, -r.clamp(1 - kw["eps_clip"], 1 + kw["eps_clip_high"]) * adv), clip, ratio

    monkeypatch.setattr(losses, "clipped_surrogate", pessimism_flipped)
    _assert_check_fails(checks.check_policy_loss_hand_numbers)


def test_swapped_clip_bounds_are_caught(monkeypatch):
    def swapped(ppo_kl, adv, *, eps_clip, eps_clip_high, eps_clip_c=None):
        return _right_surrogate(ppo_kl, adv, eps_clip=eps_clip_high, eps_clip_high=eps_clip, eps_clip_c=eps_clip_c)

    monkeypatch.setattr(losses, "clipped_surrogate", swapped)
    _assert_check_fails(checks.check_policy_loss_hand_numbers)


def test_k3_sign_flip_is_caught(monkeypatch):
    def k3_flipped(lp, ref, kl_type, importance_ratio=None):
        if kl_type in ("k3", "low_var_kl"):
            x = lp - ref  # should be ref - lp
            return x.exp() - 1 - x
        return _right_kl(lp, ref, kl_type, importance_ratio)

    monkeypatch.setattr(kl, "approx_kl", k3_flipped)
    _assert_check_fails(checks.check_kl_hand_numbers)


def test_gamma_lambda_swapped_in_gae_is_caught(monkeypatch):
    monkeypatch.setattr(advantages, "gae", lambda r, v, m, seg, *, gamma, lambd: _right_gae(r, v, m, seg, gamma=lambd, lambd=gamma))
    _assert_check_fails(checks.check_gae)


def test_discounting_over_masked_tokens_is_caught(monkeypatch):
    def all_tokens(token_rewards, mask, segments, *, gamma):
        out = []
        for r in segments.split(token_rewards):
            g, running = torch.zeros_like(r), 0.0
            for t in range(r.numel() - 1, -1, -1):
                running = r[t] + gamma * running
                g[t] = running
            out.append(g)
        return torch.cat(out)

    monkeypatch.setattr(advantages, "_discounted_returns", all_tokens)
    _assert_check_fails(checks.check_reinforce_plus_plus)


def test_token_mean_instead_of_sample_mean_is_caught(monkeypatch):
    right = reduce.reduce_batch

    def always_per_token(values, mask, segments, *, per_token, normalizer=None, denominators=None):
        return right(values, mask, segments, per_token=True, normalizer=normalizer, denominators=denominators)

    monkeypatch.setattr(losses, "reduce_batch", always_per_token)
    _assert_check_fails(checks.check_per_sample_reduction)
    _assert_check_fails(checks.check_policy_loss_hand_numbers)


def test_unmutated_checks_pass():
    for name in dir(checks):
        if name.startswith("check_"):
            getattr(checks, name)()
