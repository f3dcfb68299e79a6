"""Policy, SFT and value losses against hand-computed numbers: clipping, dual clip, GSPO, reductions,
entropy, KL loss, vanilla TIS, metrics and gradients."""

from __future__ import annotations

import math

import pytest
import torch

from algo_hand_checks import (
    T,
    call_packed,
    check_per_sample_reduction,
    check_policy_loss_hand_numbers,
    check_tis_hand_numbers,
    close,
    make_cfg,
)
from miles.algo import losses
from miles.algo.losses import get_loss_function, sft_loss, value_loss


def policy_loss(cfg, **kw):
    return call_packed(losses.policy_loss, cfg, **kw)
from miles.errors import UserError


def _lp(old: torch.Tensor, ratios) -> torch.Tensor:
    return (old + T(ratios).log()).requires_grad_()


def test_policy_loss_hand_numbers_and_gradients():
    check_policy_loss_hand_numbers()


def test_policy_loss_per_token_and_explicit_normalizer():
    old = [T([-1.0, -1.0, -1.0]), T([-1.0, -1.0]), T([-1.0]), T([])]
    lp = [_lp(o, r) for o, r in zip(old, [[1.5, 0.5, 1.1], [1.5, 0.5], [2.0], []])]
    adv = [T([1.0, 1.0, 1.0]), T([-1.0, -1.0]), T([1.0]), T([])]
    masks = [T([1.0, 1.0, 1.0]), T([1.0, 1.0]), T([0.0]), T([])]
    kw = dict(log_probs=lp, old_log_probs=old, advantages=adv, loss_masks=masks)
    # token losses -1.3, -0.5, -1.1, 1.5, 0.8: sum -0.6 over 5 trained tokens = -0.12
    loss, _ = policy_loss(make_cfg(eps_clip_high=0.3, calculate_per_token_loss=True), **kw)
    close(loss, -0.12)
    # per-token with the global batch token count (10) passed by the trainer: -0.6 / 10
    loss, _ = policy_loss(make_cfg(eps_clip_high=0.3, calculate_per_token_loss=True), normalizer=10, **kw)
    close(loss, -0.06)
    # per-sample sum 0.1833333 divided by a global batch of 2 samples
    loss, _ = policy_loss(make_cfg(eps_clip_high=0.3), normalizer=2, **kw)
    close(loss, 0.1833333333 / 2)


def test_dual_clip_caps_negative_advantage_loss_only():
    old = [T([-1.0, -1.0])]
    lp = [_lp(old[0], [5.0, 5.0])]
    cfg = make_cfg(eps_clip=0.2, eps_clip_high=0.2, eps_clip_c=3.0)
    loss, _ = policy_loss(cfg, log_probs=lp, old_log_probs=old, advantages=[T([-1.0, 1.0])], loss_masks=[T([1.0, 1.0])])
    # A=-1: max(5, 1.2) = 5, dual clip min(5, 3*1) = 3; A=+1: max(-5, -1.2) = -1.2 (dual clip does not apply)
    close(loss, (3.0 - 1.2) / 2)
    loss, _ = policy_loss(make_cfg(eps_clip=0.2), log_probs=lp, old_log_probs=old, advantages=[T([-1.0, 1.0])], loss_masks=[T([1.0, 1.0])])
    close(loss, (5.0 - 1.2) / 2)


def test_metrics_ratio_approx_kl_and_names():
    old = [T([-1.0, -1.0, -1.0]), T([-1.0])]
    lp = [_lp(old[0], [1.5, 0.5, 1.1]), _lp(old[1], [3.0])]
    masks = [T([1.0, 1.0, 1.0]), T([0.0])]
    _, m = policy_loss(make_cfg(), log_probs=lp, old_log_probs=old, advantages=[T([0.0] * 3), T([0.0])], loss_masks=masks)
    assert {"loss", "pg_loss", "pg_clipfrac", "ppo_kl", "entropy_loss", "approx_kl", "ratio_mean", "ratio_max", "ratio_min"} <= set(m)
    # ratio over trained tokens only (the 3.0 is masked); per-sample mean over 2 samples
    close(m["ratio_mean"], (1.5 + 0.5 + 1.1) / 3 / 2)
    close(m["ratio_max"], 1.5)
    close(m["ratio_min"], 0.5)
    # ppo_kl = old - lp = -ln(rho): mean(-ln1.5, ln2, -ln1.1) / 2 samples
    close(m["ppo_kl"], (-math.log(1.5) + math.log(2) - math.log(1.1)) / 3 / 2)
    # approx_kl = mean(rho - 1 - ln rho) = (0.0945349 + 0.1931472 + 0.0046898) / 3 / 2
    close(m["approx_kl"], (0.0945348919 + 0.1931471806 + 0.0046898202) / 3 / 2)
    assert all(v.dim() == 0 and not v.requires_grad for v in m.values())


def test_gspo_uses_masked_sequence_ratio():
    old = [T([-1.0, -1.0]), T([-1.0, -1.0])]
    lp = [_lp(old[0], [2.0, 1.0]), _lp(old[1], [2.0, 1.0])]
    cfg = make_cfg(advantage_estimator="gspo", eps_clip=0.2, eps_clip_high=0.3)
    loss, m = policy_loss(cfg, log_probs=lp, old_log_probs=old, advantages=[T([-1.0, -1.0])] * 2, loss_masks=[T([1.0, 1.0]), T([1.0, 0.0])])
    # sample 1: sequence ratio = exp(mean(ln2, 0)) = sqrt(2) on both tokens, A=-1: max(1.4142, 1.3) = 1.4142
    # sample 2: only token 0 is trained: ratio exp(ln 2) = 2 -> max(2, 1.3) = 2
    close(loss, (math.sqrt(2) + 2.0) / 2)
    close(m["ratio_max"], 2.0)
    loss.backward()
    # d/dlp_t of sqrt(2)-loss = rho * (1/2) per token / 2 samples; sample 2 gets all its gradient on token 0
    close(lp[0].grad, [math.sqrt(2) / 4, math.sqrt(2) / 4])
    close(lp[1].grad, [2.0 / 2, 0.0])


def test_entropy_bonus_and_missing_entropy():
    old = [T([-1.0, -1.0, -1.0])]
    lp = [old[0].clone().requires_grad_()]
    kw = dict(log_probs=lp, old_log_probs=old, advantages=[T([0.0, 0.0, 0.0])], loss_masks=[T([1.0, 1.0, 0.0])])
    loss, m = policy_loss(make_cfg(entropy_coef=0.01), entropy=[T([1.0, 2.0, 3.0])], **kw)
    # entropy mean over trained tokens (1 + 2) / 2 = 1.5; loss = 0 - 0.01 * 1.5
    close(m["entropy_loss"], 1.5)
    close(loss, -0.015)
    with pytest.raises(ValueError, match="entropy"):
        policy_loss(make_cfg(entropy_coef=0.01), **kw)


def test_kl_loss_k3_and_unbiased():
    ref = [T([-1.5, 0.5])]
    lp = [T([-1.0, -0.5], requires_grad=True)]
    kw = dict(log_probs=lp, advantages=[T([0.0, 0.0])], loss_masks=[T([1.0, 1.0])], ref_log_probs=ref)
    cfg = make_cfg(use_kl_loss=True, kl_loss_coef=0.5, kl_loss_type="k3")
    loss, m = policy_loss(cfg, old_log_probs=[T([-1.0, -0.5])], **kw)
    # k3 = [e^-0.5 - 0.5, e - 2] = [0.1065307, 0.7182818], mean 0.4124062; loss = 0.5 * 0.4124062
    close(m["kl_loss"], 0.4124062441)
    close(loss, 0.2062031220)
    cfg = make_cfg(use_kl_loss=True, kl_loss_coef=0.5, kl_loss_type="k3", use_unbiased_kl=True)
    _, m = policy_loss(cfg, old_log_probs=[T([-1.2, -0.5])], **kw)
    # token 0 weighted by pi/pi_old = e^0.2 = 1.2214028: (0.1301168 + 0.7182818) / 2
    close(m["kl_loss"], 0.4241993350)


def test_kl_loss_needs_reference():
    with pytest.raises(ValueError, match="reference"):
        policy_loss(make_cfg(use_kl_loss=True), log_probs=[T([-1.0])], old_log_probs=[T([-1.0])], advantages=[T([1.0])], loss_masks=[T([1.0])])


def test_vanilla_tis_weights_and_metrics():
    old = [T([-1.0, -1.0, -1.0])]
    rollout = [old[0] - T([3.0, 1.0, 0.25]).log()]  # rho = exp(old - rollout) = [3, 1, 0.25]
    cfg = make_cfg(use_tis=True, tis_clip=2.0, tis_clip_low=0.5)
    loss, m = policy_loss(
        cfg, log_probs=[old[0].clone().requires_grad_()], old_log_probs=old, advantages=[T([1.0] * 3)],
        loss_masks=[T([1.0] * 3)], rollout_log_probs=rollout,
    )
    # pg = -1 per token (ratio 1, A 1), weights clamp([3, 1, 0.25], 0.5, 2) = [2, 1, 0.5] -> mean(-2, -1, -0.5)
    close(loss, -3.5 / 3)
    close(m["tis"], (3 + 1 + 0.25) / 3)
    close(m["tis_clipfrac"], 2 / 3)
    close(m["tis_abs"], (2 + 0 + 0.75) / 3)
    # old vs rollout: |ln 3|, 0, |ln 0.25|
    close(m["train_rollout_logprob_abs_diff"], (math.log(3) + math.log(4)) / 3)


def test_vanilla_tis_two_samples_masked_token_and_gradients():
    check_tis_hand_numbers()  # red under a one-character change of the weight (tests/algo/test_algo_mutations.py)


def test_tis_needs_rollout_log_probs():
    with pytest.raises(ValueError, match="rollout log-probs"):
        policy_loss(make_cfg(use_tis=True), log_probs=[T([-1.0])], old_log_probs=[T([-1.0])], advantages=[T([1.0])], loss_masks=[T([1.0])])


def test_nan_in_masked_token_does_not_poison_loss():
    old = [T([-1.0, float("nan")])]
    lp = [T([-1.0, float("nan")], requires_grad=True)]
    loss, m = policy_loss(make_cfg(), log_probs=lp, old_log_probs=old, advantages=[T([2.0, float("nan")])], loss_masks=[T([1.0, 0.0])])
    close(loss, -2.0)
    loss.backward()
    assert torch.isfinite(lp[0].grad).all()


def test_all_empty_batch_gives_zero_loss_with_gradient_path():
    lp = [torch.zeros(0, requires_grad=True)]
    loss, m = policy_loss(make_cfg(), log_probs=lp, old_log_probs=[T([])], advantages=[T([])], loss_masks=[T([])])
    close(loss, 0.0)
    assert loss.requires_grad
    loss.backward()


def test_sft_loss_reductions():
    check_per_sample_reduction()


def test_value_loss_hand_numbers():
    cfg = make_cfg(value_clip=0.2)
    v = [T([1.0, 0.5, 0.3], requires_grad=True)]
    loss, m = call_packed(value_loss, cfg, values=v, old_values=[T([0.5, 0.45, 0.0])], returns=[T([0.6, 1.0, 1.0])], loss_masks=[T([1.0, 1.0, 1.0])])
    # t0: v-v_old = 0.5 clipped to 0.2 -> 0.7: max((1-0.6)^2, (0.7-0.6)^2) = 0.16 (clipped)
    # t1: 0.05 within the clip: (0.5-1)^2 = 0.25
    # t2: 0.3 clipped to 0.2: max((0.3-1)^2, (0.2-1)^2) = 0.64 (clipped)
    close(loss, (0.16 + 0.25 + 0.64) / 3)
    close(m["value_clipfrac"], 2 / 3)
    loss.backward()
    # t0: gradient of (v - R)^2 / 3 = 2*0.4/3; t1: 2*(-0.5)/3; t2: the clipped branch is constant in v -> 0
    close(v[0].grad, [0.8 / 3, -1.0 / 3, 0.0])


def test_value_loss_clips_below_the_old_value_too():
    """The clip is two-sided: a value that fell more than value_clip under the old one is clipped up."""
    cfg = make_cfg(value_clip=0.2)
    v = [T([-0.5, 0.1], requires_grad=True), T([0.0], requires_grad=True)]
    loss, m = call_packed(
        value_loss, cfg, values=v, old_values=[T([0.0, 0.0]), T([0.5])], returns=[T([-1.0, 0.0]), T([1.0])],
        loss_masks=[T([1.0, 1.0]), T([1.0])],
    )
    # sample 1, t0: -0.5 clipped up to -0.2: max((-0.5+1)^2, (-0.2+1)^2) = max(0.25, 0.64) = 0.64 (clipped)
    #           t1: 0.1 within the clip: 0.01; per-sample mean (0.64 + 0.01) / 2 = 0.325
    # sample 2: 0.0 is 0.5 under 0.5, clipped up to 0.3: max((0-1)^2, (0.3-1)^2) = 1.0 (unclipped)
    close(loss, (0.325 + 1.0) / 2)
    close(m["value_clipfrac"], (0.5 + 1.0) / 2)
    loss.backward()
    close(v[0].grad, [0.0, 2 * 0.1 / 2 / 2])
    close(v[1].grad, [2 * (0.0 - 1.0) / 2])


def test_get_loss_function_dispatch(tmp_path, monkeypatch):
    assert get_loss_function(make_cfg()) is losses.policy_loss
    assert get_loss_function(make_cfg(loss_type="sft_loss")) is sft_loss
    assert get_loss_function(make_cfg(), critic=True) is value_loss
    (tmp_path / "my_loss.py").write_text("def loss(cfg, **kw):\n    return 42, {}\n")
    fn = get_loss_function(make_cfg(loss_type="custom_loss", custom_loss_function_path=f"{tmp_path / 'my_loss.py'}:loss"))
    assert fn(None, log_probs=[]) == (42, {})
    with pytest.raises(UserError, match="--custom-loss-function-path"):
        get_loss_function(make_cfg(loss_type="custom_loss", custom_loss_function_path="miles.algo.nope.loss"))


def test_unresolved_eps_clip_high_is_an_internal_error():
    from miles.config.algo import AlgoConfig

    with pytest.raises(ValueError, match="resolve"):
        policy_loss(AlgoConfig(), log_probs=[T([-1.0])], old_log_probs=[T([-1.0])], advantages=[T([1.0])], loss_masks=[T([1.0])])


def test_explained_variance_hand_numbers_and_dp_sums():
    """1 - Var(R - V) / Var(R) over trained tokens; the terms are sums, so two halves add up to the whole."""
    from miles.algo.reduce import explained_variance_from_terms, explained_variance_terms

    v, r, m = T([0.0, 1.0, 2.0, 9.0]), T([1.0, 1.0, 3.0, 0.0]), T([1.0, 1.0, 1.0, 0.0])
    # trained: R = [1, 1, 3] (mean 5/3, var 8/9); R - V = [1, 0, 1] (mean 2/3, var 2/9); V mean 1
    out = explained_variance_from_terms(explained_variance_terms(v, r, m))
    close(out["critic/explained_variance"], 1 - (2 / 9) / (8 / 9))
    close(out["critic/value_mean"], 1.0)
    halves = explained_variance_terms(v[:2], r[:2], m[:2]) + explained_variance_terms(v[2:], r[2:], m[2:])
    assert explained_variance_from_terms(halves) == pytest.approx(out)
    assert explained_variance_from_terms(explained_variance_terms(v, T([1.0, 1.0, 1.0, 5.0]), m))["critic/explained_variance"] == 0.0
