"""Entropy of the next-token distribution at every position, from logits.

`entropy_from_logits(logits)` returns `H = -sum_v p_v log p_v` over the last dimension, computed
from `log_softmax` (so large logits do not overflow) and with `0 log 0 = 0`, so vocabulary entries
masked to `-inf` give neither NaN values nor NaN gradients. It is differentiable: the trainer passes
its result to `policy_loss(entropy=...)` for `--entropy-coef`. It is not vocab-parallel: a
tensor-parallel trainer must gather the vocabulary first.
"""

from __future__ import annotations

import torch


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy over the last dimension: shape `logits.shape[:-1]`, dtype at least float32."""
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    log_p = torch.log_softmax(logits, dim=-1)
    p = log_p.exp()
    # p = 0 where log_p = -inf: replace log_p by 0 there, so both p*log_p and its gradient are 0.
    safe_log_p = log_p.masked_fill(~torch.isfinite(log_p), 0.0)
    return -(p * safe_log_p).sum(dim=-1)
