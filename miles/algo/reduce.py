"""Masked reductions shared by every loss and metric in `miles.algo`.

A batch is a list of 1-D tensors (one per sample, over its response tokens) with 0/1 masks of the
same lengths. `reduce_batch` turns per-token values into the scalar a loss returns:

- per-sample mean (default): `sum_i [ sum_t m_it x_it / max(d_i, 1) ]`, where `d_i` is the sample's
  masked-token count (or a given denominator, see below);
- per-token (`--calculate-per-token-loss`): `sum_i sum_t m_it x_it`;

then divided by `normalizer`. The trainer passes the global-batch number of samples (per-sample mode)
or of masked tokens (per-token mode) because it accumulates gradients over micro-batches, so the sum
over micro-batches is the step's mean; `normalizer=None` uses this call's own count. Counts are
clamped to at least 1, so a sample with no trained tokens (an empty response) contributes 0, not NaN.

`denominators` keeps the original per-sample token counts when rejection sampling zeroes part of a
mask: rejected tokens then lower the mean rather than being renormalised away.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def masked_sum(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum()


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of `x` over positions where `mask` is 1; 0 when the mask is empty."""
    return masked_sum(x, mask) / mask.sum().clamp_min(1)


def batch_count(masks: Sequence[torch.Tensor], *, per_token: bool) -> float:
    """The default normalizer: number of samples, or of masked tokens with `per_token`."""
    if per_token:
        return float(sum(float(m.sum()) for m in masks))
    return float(len(masks))


def reduce_batch(
    values: Sequence[torch.Tensor],
    masks: Sequence[torch.Tensor],
    *,
    per_token: bool,
    normalizer: float | torch.Tensor | None = None,
    denominators: Sequence[torch.Tensor | float] | None = None,
) -> torch.Tensor:
    """Reduce per-token `values` to a scalar as described in the module docstring."""
    if len(values) != len(masks):
        raise ValueError(f"{len(values)} value tensors but {len(masks)} masks")
    if normalizer is None:
        normalizer = batch_count(masks if denominators is None else _as_masks(denominators), per_token=per_token)
    if not values:
        return torch.zeros(())
    total = values[0].new_zeros(()) if values[0].is_floating_point() else torch.zeros(())
    for i, (x, m) in enumerate(zip(values, masks)):
        if x.shape != m.shape:
            raise ValueError(f"sample {i}: values of shape {tuple(x.shape)} but mask of shape {tuple(m.shape)}")
        s = masked_sum(x, m)
        if not per_token:
            d = m.sum() if denominators is None else torch.as_tensor(denominators[i], dtype=s.dtype)
            s = s / d.clamp_min(1)
        total = total + s
    if isinstance(normalizer, torch.Tensor):
        return total / normalizer.clamp_min(1)
    return total / max(float(normalizer), 1.0)


def _as_masks(denominators: Sequence[torch.Tensor | float]) -> list[torch.Tensor]:
    # batch_count only reads .sum() of each entry, so a 0-d count stands in for a mask.
    return [torch.as_tensor(d, dtype=torch.float32) for d in denominators]


def masked_extreme(values: Sequence[torch.Tensor], masks: Sequence[torch.Tensor], *, largest: bool) -> torch.Tensor:
    """Max (or min) of `values` over all masked positions of the batch; 0 when nothing is masked in."""
    picked = [x.detach()[m.bool()] for x, m in zip(values, masks)]
    flat = torch.cat(picked) if picked else torch.zeros(0)
    if flat.numel() == 0:
        return torch.zeros(())
    return flat.max() if largest else flat.min()
