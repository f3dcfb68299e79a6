"""On-policy distillation's term against hand-computed numbers: two samples, one masked token.

Sample A (reward 1.0, mask [1, 1]): student [-0.5, -1.0], teacher [-0.2, -2.0] -> reverse KL
[-0.3, 1.0]; sample B (reward -0.5, mask [1, 0, 1]): student [-1.0, -3.0, -0.1], teacher
[-1.5, -0.5, -0.1] -> reverse KL [0.5, (masked), 0.0]. With --opd-kl-coef 0.5 and grpo (n=1, so the
rewards are the advantages): A' = [1 + 0.15, 1 - 0.5] = [1.15, 0.5], B' = [-0.5 - 0.25, 0, -0.5].
A sign flip, swapped student/teacher or an ignored mask each change a number below.
"""

from __future__ import annotations

import torch

from algo_hand_checks import T, close, make_cfg, packed
from miles.algo import advantages as _advantages
from miles.algo.opd import apply_opd, reverse_kl
from miles.backends.base import PackedBatch

MASKS = [T([1.0, 1.0]), T([1.0, 0.0, 1.0])]
STUDENT = [T([-0.5, -1.0]), T([-1.0, -3.0, -0.1])]
TEACHER = [T([-0.2, -2.0]), T([-1.5, -0.5, -0.1])]
REWARDS = T([1.0, -0.5])


def _advantages_with_opd(cfg, coef=0.5):
    mask, seg = packed(MASKS)
    adv, ret = _advantages.compute_advantages_and_returns(
        cfg, rewards=REWARDS, loss_mask=mask, segments=seg, n_samples_per_prompt=1,
        log_probs=packed(STUDENT)[0], teacher_log_probs=packed(TEACHER)[0], opd_kl_coef=coef,
    )
    return seg.split(adv), seg.split(ret)


def test_reverse_kl_is_student_minus_teacher_on_trained_tokens():
    close(reverse_kl(packed(STUDENT)[0], packed(TEACHER)[0], packed(MASKS)[0]), [-0.3, 1.0, 0.5, 0.0, 0.0])


def test_opd_shapes_grpo_advantages_by_hand():
    adv, ret = _advantages_with_opd(make_cfg(advantage_estimator="grpo"))
    close(adv[0], [1.15, 0.5])
    close(adv[1], [-0.75, 0.0, -0.5])
    # The returns (a critic's targets) never see the teacher.
    close(ret[0], [1.0, 1.0])
    close(ret[1], [-0.5, 0.0, -0.5])


def test_opd_coef_zero_and_no_teacher_leave_advantages_alone():
    adv, _ = _advantages_with_opd(make_cfg(advantage_estimator="grpo"), coef=0.0)
    close(adv[1], [-0.5, 0.0, -0.5])


def test_opd_is_applied_before_whitening():
    cfg = make_cfg(advantage_estimator="grpo", normalize_advantages=True)
    adv, _ = _advantages_with_opd(cfg)
    mask, seg = packed(MASKS)
    shaped = packed([T([1.15, 0.5]), T([-0.75, 0.0, -0.5])])[0]
    # mean of trained tokens = (1.15 + 0.5 - 0.75 - 0.5) / 4 = 0.1
    expected = _advantages.whiten(shaped, mask)
    close(torch.cat(adv), expected)
    assert abs(float((torch.cat(adv) * mask).sum())) < 1e-6  # whitened after OPD: zero mean


def test_apply_opd_refuses_mismatched_lengths():
    import pytest

    with pytest.raises(ValueError, match="one teacher log-prob per student token"):
        apply_opd(T([1.0, 1.0]), student_log_probs=T([0.0, 0.0]), teacher_log_probs=T([0.0]), mask=T([1.0, 1.0]), kl_coef=1.0)


def test_packed_loss_reports_opd_reverse_kl_reduced_like_the_loss():
    from miles.train.loss import packed_loss

    mask, seg = packed(MASKS)
    student = packed(STUDENT)[0]
    batch = PackedBatch(
        tokens=torch.zeros(9, dtype=torch.int64), cu_seqlens=T([0, 4, 9]), response_lengths=T([2, 3]), loss_mask=mask,
        advantages=torch.zeros(5), old_log_probs=student, teacher_log_probs=packed(TEACHER)[0],
    )
    _, metrics = packed_loss(make_cfg(), student.clone().requires_grad_(True), None, batch, normalizer=2.0)
    # per-sample means over trained tokens: A (-0.3 + 1.0) / 2 = 0.35, B (0.5 + 0.0) / 2 = 0.25; / 2 samples
    close(metrics["opd_reverse_kl"], 0.3)
    _, per_token = packed_loss(make_cfg(calculate_per_token_loss=True), student.clone().requires_grad_(True), None, batch, normalizer=4.0)
    close(per_token["opd_reverse_kl"], (-0.3 + 1.0 + 0.5 + 0.0) / 4)
