"""Masked reductions shared by every loss and metric in `miles.algo`, over packed tokens.

A batch is a flat [R] tensor over the response tokens of B samples (`Segments` says which tokens
belong to which sample) with a 0/1 [R] mask. `reduce_batch` turns per-token values into the scalar a
loss returns:

- per-sample mean (default): `sum_i [ sum_t m_it x_it / max(d_i, 1) ]`, where `d_i` is the sample's
  masked-token count (or a given denominator, see below);
- per-token (`--calculate-per-token-loss`): `sum_i sum_t m_it x_it`;

then divided by `normalizer`. The trainer passes the global-batch number of samples (per-sample mode)
or of masked tokens (per-token mode) because it accumulates gradients over micro-batches, so the sum
over micro-batches is the step's mean; `normalizer=None` uses this call's own count. Counts are
clamped to at least 1, so a sample with no trained tokens (an empty response) contributes 0, not NaN.

`denominators` ([B]) keeps the original per-sample token counts when rejection sampling zeroes part
of a mask: rejected tokens then lower the mean rather than being renormalised away.
"""

from __future__ import annotations

import torch

from miles.algo.segments import Segments


def masked_sum(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum()


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of `x` over positions where `mask` is 1; 0 when the mask is empty."""
    return masked_sum(x, mask) / mask.sum().clamp_min(1)


def segment_masked_mean(x: torch.Tensor, mask: torch.Tensor, segments: Segments) -> torch.Tensor:
    """[B]: each sample's mean of `x` over its masked-in tokens; 0 for a sample with none."""
    return segments.sum(x * mask) / segments.sum(mask).clamp_min(1)


def batch_count(mask: torch.Tensor, segments: Segments, *, per_token: bool, denominators: torch.Tensor | None = None) -> float:
    """The default normalizer: number of samples, or of masked tokens with `per_token`."""
    if per_token:
        return float(mask.sum() if denominators is None else denominators.sum())
    return float(segments.num_segments)


def reduce_batch(
    values: torch.Tensor,
    mask: torch.Tensor,
    segments: Segments,
    *,
    per_token: bool,
    normalizer: float | torch.Tensor | None = None,
    denominators: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reduce per-token `values` [R] to a scalar as described in the module docstring."""
    if values.shape != mask.shape or values.dim() != 1 or values.numel() != segments.num_tokens:
        raise ValueError(
            f"values of shape {tuple(values.shape)} and mask of shape {tuple(mask.shape)} do not match the "
            f"{segments.num_tokens} packed tokens"
        )
    if normalizer is None:
        normalizer = batch_count(mask, segments, per_token=per_token, denominators=denominators)
    if per_token:
        total = masked_sum(values, mask)
    else:
        d = segments.sum(mask) if denominators is None else denominators.to(values.dtype)
        total = (segments.sum(values * mask) / d.clamp_min(1)).sum()
    if isinstance(normalizer, torch.Tensor):
        return total / normalizer.clamp_min(1)
    return total / max(float(normalizer), 1.0)


def masked_extreme(values: torch.Tensor, mask: torch.Tensor, *, largest: bool) -> torch.Tensor:
    """Max (or min) of `values` over all masked positions of the batch; 0 when nothing is masked in."""
    picked = values.detach()[mask.bool()]
    if picked.numel() == 0:
        return values.new_zeros(())
    return picked.max() if largest else picked.min()


def explained_variance_terms(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """float64 [6] sums over the trained tokens: count, sum V, sum R, sum R^2, sum (R - V), sum (R - V)^2.

    Sums (not means), so a data-parallel group adds its ranks' terms and gets the whole batch's
    statistics (`explained_variance_from_terms`)."""
    m = mask.to(torch.float64)
    v, r = values.detach().to(torch.float64), returns.detach().to(torch.float64)
    d = r - v
    return torch.stack([m.sum(), (v * m).sum(), (r * m).sum(), (r * r * m).sum(), (d * m).sum(), (d * d * m).sum()])


def explained_variance_from_terms(terms: torch.Tensor) -> dict[str, float]:
    """`critic/value_mean` and `critic/explained_variance` = 1 - Var(R - V) / Var(R) (population
    variances over the trained tokens); 1 is a perfect critic, 0 no better than the mean return,
    negative worse. With no trained token both are 0; with constant returns (every reward equal)
    the ratio is undefined and explained variance is reported as 0."""
    n, sv, sr, srr, sd, sdd = (float(t) for t in terms)
    if n == 0:
        return {"critic/value_mean": 0.0, "critic/explained_variance": 0.0}
    var_r = max(srr / n - (sr / n) ** 2, 0.0)
    var_d = max(sdd / n - (sd / n) ** 2, 0.0)
    explained = 0.0 if var_r < 1e-12 else 1.0 - var_d / var_r
    return {"critic/value_mean": sv / n, "critic/explained_variance": explained}
