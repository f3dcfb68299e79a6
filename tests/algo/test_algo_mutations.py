"""The hand-number checks catch real bugs: swap in a deliberately wrong implementation and the same
check must fail. If one of these tests fails, a check has gone blind to the bug it names."""

from __future__ import annotations

import pytest
import torch

import algo_hand_checks as checks
from miles.algo import advantages, kl, losses, reduce, rollout_correction
from miles.rollout import train_data

_right_normalize = advantages.normalize_group_rewards
_right_kl = kl.approx_kl
_right_surrogate = losses.clipped_surrogate
_right_gae = advantages.gae
_right_tis = rollout_correction.vanilla_tis


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


def _tis_variant(weight):
    """A vanilla_tis whose per-token weight is `weight(train_logp, rollout_logp, cfg)` (metrics unchanged)."""

    def tis(cfg, *, pg_loss, train_log_probs, rollout_log_probs, loss_mask, **kw):
        _, mask, metrics = _right_tis(cfg, pg_loss=pg_loss, train_log_probs=train_log_probs, rollout_log_probs=rollout_log_probs, loss_mask=loss_mask, **kw)
        return pg_loss * weight(train_log_probs.detach(), rollout_log_probs.detach(), cfg), mask, metrics

    return tis


@pytest.mark.parametrize(
    "weight",
    [
        lambda t, r, c: (r - t).exp().clamp(c.tis_clip_low, c.tis_clip),  # importance ratio upside down
        lambda t, r, c: (t - r).exp().clamp(c.tis_clip, c.tis_clip_low),  # bounds swapped
        lambda t, r, c: (t - r).exp(),  # not truncated
        lambda t, r, c: (t - r).exp().clamp(max=c.tis_clip),  # lower bound ignored
    ],
    ids=["ratio-inverted", "bounds-swapped", "untruncated", "no-lower-bound"],
)
def test_wrong_tis_weight_is_caught(monkeypatch, weight):
    monkeypatch.setattr(losses, "vanilla_tis", _tis_variant(weight))
    _assert_check_fails(checks.check_tis_hand_numbers)


def test_tis_weight_on_the_current_policy_is_caught(monkeypatch):
    # the weight must use the trainer's old log-probs (before this step's updates), not the ones being trained
    right_policy_loss = losses.policy_loss

    def current_policy(cfg, *, log_probs, old_log_probs, rollout_log_probs=None, **kw):
        def tis(cfg, *, pg_loss, train_log_probs, **rest):
            return _right_tis(cfg, pg_loss=pg_loss, train_log_probs=log_probs.detach(), **rest)

        monkeypatch.setattr(losses, "vanilla_tis", tis)
        try:
            return right_policy_loss(cfg, log_probs=log_probs, old_log_probs=old_log_probs, rollout_log_probs=rollout_log_probs, **kw)
        finally:
            monkeypatch.setattr(losses, "vanilla_tis", _right_tis)

    monkeypatch.setattr(losses, "policy_loss", current_policy)
    _assert_check_fails(checks.check_tis_hand_numbers)


def test_tis_denominator_over_the_returned_mask_only_is_caught(monkeypatch):
    # rejected tokens must lower a sample's mean (denominator: the original token count), not vanish from it
    right = reduce.reduce_batch

    def renormalised(values, mask, segments, *, per_token, normalizer=None, denominators=None):
        return right(values, mask, segments, per_token=per_token, normalizer=normalizer, denominators=None)

    def rejecting_tis(cfg, *, pg_loss, loss_mask, **kw):
        out, _, metrics = _right_tis(cfg, pg_loss=pg_loss, loss_mask=loss_mask, **kw)
        return out, loss_mask * (torch.arange(loss_mask.numel()) != 1).float(), metrics  # reject token 1

    monkeypatch.setattr(losses, "vanilla_tis", rejecting_tis)
    # with the right reduction: sample 1 = (-2.2103418 - 0.7884533) / 3 (token 1 rejected, still counted)
    loss, _ = _tis_loss()
    checks.close(loss, ((-2.2103418362 - 0.7884533223) / 3 + 0.8) / 2)
    monkeypatch.setattr(losses, "reduce_batch", renormalised)
    with pytest.raises(AssertionError):
        checks.close(_tis_loss()[0], ((-2.2103418362 - 0.7884533223) / 3 + 0.8) / 2)


def _tis_loss():
    T = checks.T
    old, seg = checks.packed([T([-1.0, -1.0, -1.0]), T([-1.0, -1.0])])
    rho, _ = checks.packed([T([3.0, 0.5, 1.5]), T([0.25, 10.0])])
    lp = old + T([0.1, -0.1, 0.05, 0.0, 0.0])
    adv, _ = checks.packed([T([1.0, -2.0, 0.5]), T([-1.0, 5.0])])
    masks, _ = checks.packed([T([1.0, 1.0, 1.0]), T([1.0, 0.0])])
    cfg = checks.make_cfg(use_tis=True, tis_clip=2.0, tis_clip_low=0.8)
    return losses.policy_loss(cfg, log_probs=lp, old_log_probs=old, advantages=adv, loss_mask=masks, segments=seg, rollout_log_probs=old - rho.log())


def test_unmutated_checks_pass():
    for name in dir(checks):
        if name.startswith("check_"):
            getattr(checks, name)()
