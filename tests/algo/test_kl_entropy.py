"""KL estimators and entropy against hand-computed values, including the clamps and -inf logits."""

from __future__ import annotations

import math

import pytest
import torch

from algo_hand_checks import T, check_kl_hand_numbers, close
from miles.algo.entropy import entropy_from_logits
from miles.algo.kl import approx_kl


def test_kl_estimators_match_hand_numbers():
    check_kl_hand_numbers()


def test_k3_is_non_negative_and_zero_only_at_equal_probs():
    lp = torch.linspace(-5, 0, 11)
    ref = torch.full_like(lp, -2.5)
    k3 = approx_kl(lp, ref, "k3")
    assert (k3 >= 0).all()
    assert k3[5] == 0.0  # lp == ref at index 5


def test_importance_ratio_multiplies_estimate():
    lp, ref = T([-1.0, -2.0, -0.5]), T([-1.5, -2.0, 0.5])
    # k3 = [0.1065307, 0, 0.7182818] times [2, 1, 0.5]
    close(approx_kl(lp, ref, "k3", importance_ratio=T([2.0, 1.0, 0.5])), [0.2130613194, 0.0, 0.3591409142])


def test_low_var_kl_clamps_log_ratio_then_result():
    lp = T([-31.0, 29.0, -4.0])
    ref = T([-1.0, -1.0, -1.0])  # r = [-30, 30, -3]
    # r=-30: x=30 clamped to 20 -> e^20 - 21 ~ 4.9e8 -> clamped to 10
    # r=+30: x=-30 clamped to -20 -> e^-20 + 19 = 19.0000000021 -> clamped to 10
    # r=-3: x=3 -> e^3 - 4 = 16.0855 -> 10
    close(approx_kl(lp, ref, "low_var_kl"), [10.0, 10.0, 10.0])
    # plain k3 has no clamp: r=-3 gives 16.0855369
    close(approx_kl(lp, ref, "k3")[2], 16.0855369232)


def test_low_var_kl_clamp_applies_after_importance_ratio():
    # r = -3: k3 = 16.0855369, times ratio 0.5 = 8.0427685 (inside [-10, 10]); clamping before the ratio would give 5
    out = approx_kl(T([-4.0]), T([-1.0]), "low_var_kl", importance_ratio=T([0.5]))
    close(out, [8.0427684616])


def test_low_var_kl_maps_nan_to_zero_kl():
    out = approx_kl(T([float("nan")]), T([-1.0]), "low_var_kl")
    close(out, [0.0])


def test_kl_computes_in_float32_for_bf16_inputs():
    out = approx_kl(T([-1.0]).bfloat16(), T([-1.5]).bfloat16(), "k2")
    assert out.dtype == torch.float32
    close(out, [0.125])


def test_unknown_kl_type_is_rejected():
    with pytest.raises(ValueError, match="unknown KL type"):
        approx_kl(T([0.0]), T([0.0]), "k4")


def test_entropy_hand_numbers():
    logits = T([[0.0, math.log(3.0), float("-inf"), float("-inf")], [1.0, 1.0, 1.0, 1.0], [1000.0, 1000.0, -1000.0, -1000.0]])
    # p = [1/4, 3/4, 0, 0]: H = -(0.25 ln 0.25 + 0.75 ln 0.75) = 0.5623351; uniform over 4: ln 4; two equal huge logits: ln 2
    close(entropy_from_logits(logits), [0.5623351446, math.log(4), math.log(2)])


def test_entropy_gradient_is_finite_with_masked_vocab_and_matches_formula():
    logits = T([[0.3, -1.2, 2.0, float("-inf")]], requires_grad=True)
    entropy_from_logits(logits).sum().backward()
    assert torch.isfinite(logits.grad).all()
    # dH/dz_i = -p_i (log p_i + H) on the finite entries; 0 on the masked one
    p = torch.softmax(logits.detach()[0, :3], dim=0)
    h = -(p * p.log()).sum()
    close(logits.grad[0, :3], -p * (p.log() + h))
    assert logits.grad[0, 3] == 0.0


def test_entropy_shape_follows_leading_dims():
    assert entropy_from_logits(torch.zeros(2, 5, 7)).shape == (2, 5)
    close(entropy_from_logits(torch.zeros(2, 5, 7)), torch.full((2, 5), math.log(7)))
