"""The one call from the RL step into miles.algo's loss, on a packed batch.

Every backend computes per-response-token log-probs (and entropy) its own way and hands them to the
loss function the RL step gives it (`miles.train.step`), which calls `packed_loss`; the loss itself
has one implementation. Use:

    loss, metrics = packed_loss(cfg.algo, log_probs, entropy, batch, normalizer)
"""

from __future__ import annotations

from typing import Any

import torch

from miles.backends.base import PackedBatch


def packed_loss(cfg, log_probs: torch.Tensor, entropy: torch.Tensor | None, batch: PackedBatch,
                normalizer: float) -> tuple[torch.Tensor, dict[str, Any]]:
    """The configured loss (`--loss-type`) of `batch`; on-policy old log-probs default to the detached ones.
    With teacher log-probs (`--use-opd`) its metrics add `opd_reverse_kl`, reduced like the loss."""
    from miles.algo.losses import get_loss_function
    from miles.algo.segments import Segments

    fn = get_loss_function(cfg)
    segments = Segments(batch.response_cu_seqlens)
    if cfg.loss_type == "sft_loss":
        return fn(cfg, log_probs=log_probs, loss_mask=batch.loss_mask, segments=segments, normalizer=normalizer)
    old_log_probs = batch.old_log_probs if batch.old_log_probs is not None else log_probs.detach()
    loss, metrics = fn(
        cfg,
        log_probs=log_probs,
        old_log_probs=old_log_probs,
        advantages=batch.advantages,
        loss_mask=batch.loss_mask,
        segments=segments,
        ref_log_probs=batch.ref_log_probs,
        rollout_log_probs=batch.rollout_log_probs,
        entropy=entropy,
        normalizer=normalizer,
    )
    if batch.teacher_log_probs is not None:
        from miles.algo.opd import reverse_kl
        from miles.algo.reduce import reduce_batch

        kl = reverse_kl(old_log_probs, batch.teacher_log_probs, batch.loss_mask)
        metrics = {**metrics, "opd_reverse_kl": reduce_batch(
            kl, batch.loss_mask, segments, per_token=cfg.calculate_per_token_loss, normalizer=normalizer
        )}
    return loss, metrics


def packed_value_loss(cfg, values: torch.Tensor, batch: PackedBatch, normalizer: float) -> tuple[torch.Tensor, dict[str, Any]]:
    """The critic's clipped value loss (`--value-clip`) of `batch` against its GAE returns."""
    from miles.algo.losses import value_loss
    from miles.algo.segments import Segments

    if batch.old_values is None or batch.returns is None:
        raise ValueError("the value loss needs the batch's old values and returns (miles.train.inputs.fill_value_inputs)")
    return value_loss(
        cfg,
        values=values,
        old_values=batch.old_values,
        returns=batch.returns,
        loss_mask=batch.loss_mask,
        segments=Segments(batch.response_cu_seqlens),
        normalizer=normalizer,
    )


def loss_normalizer(cfg, train_data: dict[str, Any], global_indices: list[int]) -> float:
    """What every micro-batch's loss is divided by: the global batch's sample count, or its trained-token
    count with `--calculate-per-token-loss`, so the accumulated gradient is the global batch's mean."""
    if cfg.calculate_per_token_loss:
        return float(sum(sum(train_data["loss_masks"][i]) for i in global_indices))
    return float(len(global_indices))
