"""Per-token KL estimators between two policies from the log-probs of the sampled tokens.

`approx_kl(log_probs, ref_log_probs, kl_type)` estimates KL(pi || pi_ref) at tokens sampled from pi
(Schulman, "Approximating KL divergence"), with `r = log_probs - ref_log_probs`:

- k1: `r` (unbiased, high variance, can be negative);
- k2: `r^2 / 2` (biased, low variance);
- k3: `exp(-r) - 1 + r` (unbiased, non-negative);
- low_var_kl: k3 with `-r` clamped to [-20, 20] first (and NaN/inf mapped inside that range) and the
  result clamped to [-10, 10] (after any importance ratio), so one wild token cannot blow up the loss.

`importance_ratio` multiplies the estimate (`--use-unbiased-kl` passes pi/pi_old, so the estimate is
unbiased when the tokens came from pi_old). Used by the KL loss (`--use-kl-loss`), the reward-level KL
(`--kl-coef`) and the `approx_kl` / `train_rollout_kl` metrics. Works on tensors of any shape.
"""

from __future__ import annotations

import torch

KL_TYPES = ("k1", "k2", "k3", "low_var_kl")

# exp(20) ~ 4.9e8: far beyond any meaningful ratio, far below float32 overflow.
LOG_RATIO_CLAMP = 20.0
LOW_VAR_KL_CLAMP = 10.0


def _compute_dtype(t: torch.Tensor) -> torch.dtype:
    # bf16/fp16 log-probs lose the small differences KL is made of; never compute below fp32.
    return torch.promote_types(t.dtype, torch.float32)


def approx_kl(
    log_probs: torch.Tensor,
    ref_log_probs: torch.Tensor,
    kl_type: str,
    importance_ratio: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref); see the module docstring for each `kl_type`."""
    dtype = _compute_dtype(log_probs)
    log_ratio = log_probs.to(dtype) - ref_log_probs.to(dtype)
    if kl_type == "k1":
        kl = log_ratio
    elif kl_type == "k2":
        kl = log_ratio.square() / 2.0
    elif kl_type in ("k3", "low_var_kl"):
        neg = -log_ratio
        if kl_type == "low_var_kl":
            neg = torch.nan_to_num(neg, nan=0.0, posinf=LOG_RATIO_CLAMP, neginf=-LOG_RATIO_CLAMP)
            neg = neg.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        kl = neg.exp() - 1.0 - neg
    else:
        raise ValueError(f"unknown KL type {kl_type!r}; expected one of {KL_TYPES}")
    if importance_ratio is not None:
        kl = importance_ratio.to(dtype) * kl
    if kl_type == "low_var_kl":
        kl = kl.clamp(-LOW_VAR_KL_CLAMP, LOW_VAR_KL_CLAMP)
    return kl
