"""Advantage estimators and reward normalisation against hand-computed numbers and edge cases."""

from __future__ import annotations

import torch

from algo_hand_checks import T, check_gae, check_group_normalization, check_reinforce_plus_plus, close, make_cfg, packed
from miles.algo import advantages as _advantages
from miles.algo.advantages import normalize_group_rewards


def compute_advantages_and_returns(cfg, *, loss_masks, log_probs=None, ref_log_probs=None, values=None, **kw):
    """The packed estimator called with per-sample lists; returns per-sample lists."""
    mask, seg = packed(loss_masks)
    cat = lambda xs: None if xs is None else packed(xs)[0]  # noqa: E731
    adv, ret = _advantages.compute_advantages_and_returns(
        cfg, loss_mask=mask, segments=seg, log_probs=cat(log_probs), ref_log_probs=cat(ref_log_probs), values=cat(values), **kw
    )
    return seg.split(adv), seg.split(ret)


def whiten(advantages, masks, **kw):
    flat, seg = packed(advantages)
    return seg.split(_advantages.whiten(flat, packed(masks)[0], **kw))


def test_group_normalization_hand_numbers():
    check_group_normalization()


def test_group_normalization_without_std_only_centres():
    out = normalize_group_rewards(T([3.0, 1.0, 2.0, 2.0]), 4, std_normalization=False)
    close(out, [1.0, -1.0, 0.0, 0.0])


def test_group_normalization_single_sample_groups_give_zero_not_nan():
    # n == 1: the mean is the reward itself and the std (undefined) is skipped
    out = normalize_group_rewards(T([0.3, 1.0]), 1)
    close(out, [0.0, 0.0])


def test_group_normalization_rejects_ragged_batch():
    import pytest

    with pytest.raises(ValueError, match="groups of 4"):
        normalize_group_rewards(T([1.0, 2.0, 3.0]), 4)


def test_grpo_broadcasts_reward_to_trained_tokens_only():
    cfg = make_cfg(advantage_estimator="grpo")
    adv, ret = compute_advantages_and_returns(
        cfg, rewards=T([0.5, -1.0, 2.0]), loss_masks=[T([1.0, 1.0, 0.0]), T([1.0]), T([])], n_samples_per_prompt=1
    )
    close(adv[0], [0.5, 0.5, 0.0])
    close(adv[1], [-1.0])
    assert adv[2].shape == (0,)  # empty response: empty advantages, no NaN
    close(ret[0], [0.5, 0.5, 0.0])


def test_gspo_uses_grpo_advantages():
    a, _ = compute_advantages_and_returns(
        make_cfg(advantage_estimator="gspo"), rewards=T([0.7]), loss_masks=[T([1.0, 1.0])], n_samples_per_prompt=1
    )
    close(a[0], [0.7, 0.7])


def test_grpo_ignores_log_probs_when_kl_coef_is_zero():
    a, _ = compute_advantages_and_returns(
        make_cfg(), rewards=T([1.0]), loss_masks=[T([1.0])], n_samples_per_prompt=1, log_probs=[T([-5.0])], ref_log_probs=[T([0.0])]
    )
    close(a[0], [1.0])


def test_reinforce_plus_plus_hand_numbers():
    check_reinforce_plus_plus()


def test_reinforce_plus_plus_empty_and_fully_masked_samples_are_zero():
    cfg = make_cfg(advantage_estimator="reinforce_plus_plus", gamma=0.9)
    adv, ret = compute_advantages_and_returns(
        cfg, rewards=T([1.0, 5.0, 2.0]), loss_masks=[T([]), T([0.0, 0.0]), T([1.0, 1.0])], n_samples_per_prompt=1
    )
    assert adv[0].shape == (0,)
    close(adv[1], [0.0, 0.0])  # no trained token: the reward has nowhere to go
    close(adv[2], [0.9 * 2.0, 2.0])  # G1 = 2, G0 = 0.9 * 2


def test_reinforce_plus_plus_baseline_subtracts_token_kl():
    cfg = make_cfg(advantage_estimator="reinforce_plus_plus_baseline", kl_coef=0.1, kl_loss_type="k1")
    adv, ret = compute_advantages_and_returns(
        cfg,
        rewards=T([0.5]),
        loss_masks=[T([1.0, 0.0, 1.0])],
        n_samples_per_prompt=1,
        log_probs=[T([-1.0, -2.0, -3.0])],
        ref_log_probs=[T([-1.5, -2.0, -2.0])],
    )
    # kl = [0.5, 0, -1]: A = 0.5 - 0.1*kl = [0.45, (masked) 0, 0.6]
    close(adv[0], [0.45, 0.0, 0.6])
    close(ret[0], [0.45, 0.0, 0.6])


def test_ppo_gae_hand_numbers():
    check_gae()


def test_ppo_gae_with_kl_rewards_and_truncated_response():
    # A truncated response is bootstrapped with V = 0 after its last token, like a finished one.
    cfg = make_cfg(advantage_estimator="ppo", gamma=1.0, lambd=1.0, kl_coef=0.5, kl_loss_type="k1")
    adv, ret = compute_advantages_and_returns(
        cfg,
        rewards=T([1.0]),
        loss_masks=[T([1.0, 1.0])],
        n_samples_per_prompt=1,
        log_probs=[T([-1.0, -1.0])],
        ref_log_probs=[T([-1.2, -1.0])],
        values=[T([0.3, 0.6])],
    )
    # kl = [0.2, 0]; token rewards [-0.1, 1.0]; gamma = lambda = 1 -> A_t = sum_{k>=t} r_k - V_t
    # A1 = 1.0 - 0.6 = 0.4; A0 = -0.1 + 1.0 - 0.3 = 0.6; returns = A + V = [0.9, 1.0]
    close(adv[0], [0.6, 0.4])
    close(ret[0], [0.9, 1.0])


def test_ppo_requires_values():
    import pytest

    with pytest.raises(ValueError, match="critic"):
        compute_advantages_and_returns(make_cfg(advantage_estimator="ppo"), rewards=T([1.0]), loss_masks=[T([1.0])], n_samples_per_prompt=1)


def test_whiten_hand_numbers_and_masked_positions_stay_zero():
    # trained values 1, 2, 3: mean 2, Bessel var ((1)+(0)+(1))/2 = 1 -> [-1, 0, 1] (the 9 is masked)
    out = whiten([T([1.0, 2.0, 9.0]), T([3.0])], [T([1.0, 1.0, 0.0]), T([1.0])])
    close(out[0], [-1.0, 0.0, 0.0], tol=1e-6)
    close(out[1], [1.0], tol=1e-6)


def test_whiten_all_equal_and_all_masked_do_not_produce_nan():
    out = whiten([T([0.5, 0.5])], [T([1.0, 1.0])])
    close(out[0], [0.0, 0.0])  # var 0 -> (0) / sqrt(0 + 1e-8) = 0
    out = whiten([T([]), T([4.0])], [T([]), T([0.0])])
    assert out[0].shape == (0,) and torch.isfinite(out[1]).all()


def test_normalize_advantages_whitens_advantages_but_not_returns():
    cfg = make_cfg(advantage_estimator="reinforce_plus_plus", normalize_advantages=True)
    adv, ret = compute_advantages_and_returns(
        cfg, rewards=T([1.0, 3.0]), loss_masks=[T([1.0]), T([1.0, 1.0])], n_samples_per_prompt=1
    )
    # returns [1], [3, 3]; mean 7/3, Bessel var = ((4/3)^2 + 2*(2/3)^2)/2 = (16/9 + 8/9)/2 = 4/3
    s = (4 / 3) ** 0.5
    close(adv[0], [(1 - 7 / 3) / s], tol=1e-6)
    close(adv[1], [(3 - 7 / 3) / s] * 2, tol=1e-6)
    close(ret[1], [3.0, 3.0])


def test_rewards_count_must_match_samples():
    import pytest

    with pytest.raises(ValueError, match="2 rewards for 1 samples"):
        compute_advantages_and_returns(make_cfg(), rewards=T([1.0, 2.0]), loss_masks=[T([1.0])], n_samples_per_prompt=1)


def test_whiten_over_a_data_parallel_group_uses_the_whole_groups_statistics():
    """Two ranks holding [1, 2] and [3] (plus a masked 9) whiten like one process holding all of it:
    mean 2, Bessel var 1 -> [-1, 0] and [1]. Per-rank statistics would give [-0.707, 0.707] and [0]."""
    import threading

    shards = [([T([1.0, 2.0])], [T([1.0, 1.0])]), ([T([3.0, 9.0])], [T([1.0, 0.0])])]
    barrier, pending, results = threading.Barrier(2), [None, None], [None, None]

    def make_all_reduce(rank):
        def all_reduce(t):  # the semantics of dist.all_reduce(SUM), across the two threads
            pending[rank] = t.clone()
            barrier.wait()
            total = pending[0] + pending[1]
            barrier.wait()
            t.copy_(total)

        return all_reduce

    def rank_body(rank):
        adv, masks = shards[rank]
        results[rank] = whiten(adv, masks, all_reduce=make_all_reduce(rank))

    threads = [threading.Thread(target=rank_body, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    close(results[0][0], [-1.0, 0.0], tol=1e-6)
    close(results[1][0], [1.0, 0.0], tol=1e-6)
