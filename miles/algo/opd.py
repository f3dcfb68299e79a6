"""On-policy distillation's term (`--use-opd`): the teacher's reverse KL folded into the advantages.

For every response token t the student sampled, with `s_t` the student's (old) log-prob of it and
`q_t` the teacher's, the single-sample estimate of the reverse KL(student || teacher) is
`s_t - q_t`; upstream miles subtracts it, weighted, from the advantage the estimator computed:

    A'_t = A_t - opd_kl_coef * (s_t - q_t)        on trained tokens (loss mask 1)
    A'_t = 0                                      on masked tokens

so a token the teacher finds likelier than the student does is pushed up, one it finds unlikelier
is pushed down. It runs after the estimator and before `--normalize-advantages` whitening; it is not
part of the loss graph (every input is detached). Metric: `opd_reverse_kl`, the mean of `s_t - q_t`
over trained tokens reduced like the loss (`miles.train.loss.packed_loss` reports it).

Shapes: packed [R] tensors over the response tokens of the batch (see miles/algo/segments.py).
"""

from __future__ import annotations

import torch


def reverse_kl(student_log_probs: torch.Tensor, teacher_log_probs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[R]: `student - teacher` log-prob on trained tokens, 0 where `mask` is 0."""
    if not student_log_probs.shape == teacher_log_probs.shape == mask.shape:
        raise ValueError(
            f"OPD needs one teacher log-prob per student token: student {tuple(student_log_probs.shape)}, "
            f"teacher {tuple(teacher_log_probs.shape)}, mask {tuple(mask.shape)}"
        )
    m = mask.detach().to(torch.float32)
    diff = student_log_probs.detach().to(torch.float32) - teacher_log_probs.detach().to(torch.float32)
    # where, not a product: a masked position may hold -inf (a token the teacher cannot produce).
    return torch.where(m.bool(), diff, torch.zeros_like(diff))


def apply_opd(
    advantages: torch.Tensor,
    *,
    student_log_probs: torch.Tensor,
    teacher_log_probs: torch.Tensor,
    mask: torch.Tensor,
    kl_coef: float,
) -> torch.Tensor:
    """The advantages with the teacher's reverse KL subtracted (see the module docstring)."""
    m = mask.detach().to(torch.float32)
    return (advantages - kl_coef * reverse_kl(student_log_probs, teacher_log_probs, mask)) * m
