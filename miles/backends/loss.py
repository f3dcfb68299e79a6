"""The one call from a training backend into miles.algo's loss, on a packed batch.

Both backends (torch, megatron) compute per-response-token log-probs (and entropy) their own way and
then call `packed_loss`, so the loss itself has one implementation. Use:

    loss, metrics = packed_loss(cfg.algo, log_probs, entropy, batch, normalizer)
"""

from __future__ import annotations

from typing import Any

import torch

from miles.backends.base import PackedBatch


def packed_loss(cfg, log_probs: torch.Tensor, entropy: torch.Tensor | None, batch: PackedBatch,
                normalizer: float) -> tuple[torch.Tensor, dict[str, Any]]:
    """The configured loss (`--loss-type`) of `batch`; on-policy old log-probs default to the detached ones."""
    from miles.algo.losses import get_loss_function
    from miles.algo.segments import Segments

    fn = get_loss_function(cfg)
    segments = Segments(batch.response_cu_seqlens)
    if cfg.loss_type == "sft_loss":
        return fn(cfg, log_probs=log_probs, loss_mask=batch.loss_mask, segments=segments, normalizer=normalizer)
    return fn(
        cfg,
        log_probs=log_probs,
        old_log_probs=batch.old_log_probs if batch.old_log_probs is not None else log_probs.detach(),
        advantages=batch.advantages,
        loss_mask=batch.loss_mask,
        segments=segments,
        ref_log_probs=batch.ref_log_probs,
        rollout_log_probs=batch.rollout_log_probs,
        entropy=entropy,
        normalizer=normalizer,
    )


def combine_metric(acc: dict[str, float], key: str, value: float) -> None:
    """Fold one micro-batch's metric into the step's: `*_max`/`*_min` by max/min, the rest by sum
    (the losses normalise by the whole step, so the sum over micro-batches is the step's mean)."""
    if key not in acc:
        acc[key] = value
    elif key.endswith("_max"):
        acc[key] = max(acc[key], value)
    elif key.endswith("_min"):
        acc[key] = min(acc[key], value)
    else:
        acc[key] += value
