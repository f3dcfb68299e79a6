"""Rollout correction: importance weights for the mismatch between the rollout engine and the trainer.

The rollout engine (SGLang, or the built-in engine in another precision) samples with slightly
different probabilities than the trainer computes. With `--use-tis`, the per-token policy loss is
multiplied by a detached weight built from `rho_t = exp(train_logp_t - rollout_logp_t)`, where
`train_logp` are the trainer's old log-probs (before this step's updates):

- `vanilla_tis` (default): `w_t = clamp(rho_t, --tis-clip-low, --tis-clip)`; metrics `tis` (mean rho),
  `tis_clipfrac` (fraction of tokens whose weight was clamped), `tis_abs` (mean |rho - 1|);
- `mis_function` (`--custom-tis-function-path miles.algo.rollout_correction.mis_function`), configured
  by the YAML of `--custom-config-path` (`MisConfig`): IS weights at token, sequence or geometric
  level in truncate / clip / mask mode, rejection sampling (`use_rs`, `rs_*`, veto threshold) that
  zeroes tokens out of the loss mask, optional batch normalisation to mean 1, and mismatch metrics.
  Every metric it returns is prefixed `mis_`.

A correction function, built-in or custom, is called as

    fn(cfg, *, pg_loss, train_log_probs, rollout_log_probs, loss_mask, segments, **kwargs)
        -> (pg_loss, loss_mask, metrics)

with packed [R] tensors over the response tokens of the micro-batch and their `Segments`, and
returns the weighted per-token losses, the (possibly reduced) mask and `{name: [R] per-token
tensor}` metrics (a 0-d tensor is taken as the batch's value as is). The policy loss reduces those
metrics with the original mask, and reduces the loss with the returned mask but the original
per-sample token counts, so rejected tokens lower a sample's mean instead of being renormalised away.
Metric definitions are listed in docs/algorithms.md.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch

from miles.algo.reduce import masked_sum, segment_masked_mean
from miles.algo.segments import Segments
from miles.config.algo import AlgoConfig, MisConfig, load_mis_config

# Same safety bound as the policy ratio: exp(20) is huge but finite in float32.
LOG_RATIO_CLAMP = 20.0

Metrics = dict[str, torch.Tensor]


def vanilla_tis(
    cfg: AlgoConfig,
    *,
    pg_loss: torch.Tensor,
    train_log_probs: torch.Tensor,
    rollout_log_probs: torch.Tensor,
    loss_mask: torch.Tensor,
    **_: Any,
) -> tuple[torch.Tensor, torch.Tensor, Metrics]:
    """Truncated importance sampling: `pg_t * clamp(rho_t, tis_clip_low, tis_clip)`; mask unchanged."""
    log_rho = (train_log_probs.detach() - rollout_log_probs.detach()).to(torch.float32).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    rho = log_rho.exp()
    w = rho.clamp(cfg.tis_clip_low, cfg.tis_clip)
    metrics = {"tis": rho, "tis_clipfrac": (w != rho).float(), "tis_abs": (rho - 1).abs()}
    return pg_loss * w, loss_mask, metrics


@functools.lru_cache(maxsize=8)
def _cached_mis_config(path: str, mtime: float) -> MisConfig:
    return load_mis_config(path)


def mis_config_for(cfg: AlgoConfig) -> MisConfig:
    """The MIS settings of `cfg.custom_config_path`, read once per file version."""
    if not cfg.custom_config_path:
        raise ValueError("mis_function needs --custom-config-path (AlgoConfig.check enforces this)")
    path = cfg.custom_config_path
    mtime = os.path.getmtime(path) if os.path.exists(path) else -1.0
    return _cached_mis_config(path, mtime)


def _level_log_ratio(raw: torch.Tensor, mask: torch.Tensor, segments: Segments, level: str) -> torch.Tensor:
    """Token log-ratios, or the sequence's sum (product of ratios) / mean (geometric mean) on every token."""
    if level == "token":
        return raw
    if level == "sequence":
        return segments.broadcast(segments.sum(raw * mask))
    if level == "geometric":
        return segments.broadcast(segment_masked_mean(raw, mask, segments))
    raise ValueError(f"unknown level {level!r}")


def _segment_extreme(x: torch.Tensor, mask: torch.Tensor, segments: Segments, *, largest: bool) -> torch.Tensor:
    """[B]: each sample's max (min) of `x` over its masked-in tokens; 0 for a sample with none."""
    inside = mask.bool()
    if largest:
        out = segments.amax(torch.where(inside, x, float("-inf")))
    else:
        out = segments.amin(torch.where(inside, x, float("inf")))
    return torch.where(segments.sum(mask) > 0, out, torch.zeros_like(out))


def _mismatch_metrics(train: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor, segments: Segments, metrics: Metrics) -> None:
    """Perplexities, KL and chi-squared between the rollout and training distributions (per sample)."""
    b = segments.broadcast
    mean_train = segment_masked_mean(train, mask, segments)
    mean_rollout = segment_masked_mean(rollout, mask, segments)
    metrics["training_log_ppl"] = b(-mean_train)
    metrics["training_ppl"] = b((-mean_train).exp())
    metrics["rollout_log_ppl"] = b(-mean_rollout)
    metrics["rollout_ppl"] = b((-mean_rollout).exp())
    metrics["kl"] = rollout - train
    log_rho = train - rollout
    metrics["k3_kl"] = log_rho.exp() - 1 - log_rho
    log_ppl_diff = mean_rollout - mean_train
    metrics["log_ppl_diff"] = b(log_ppl_diff)
    metrics["log_ppl_abs_diff"] = b(log_ppl_diff.abs())
    metrics["ppl_ratio"] = b(log_ppl_diff.exp())
    rho = log_rho.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()
    metrics["chi2_token"] = b(segment_masked_mean(rho.square(), mask, segments) - 1)
    seq_log_rho = segments.sum(log_rho * mask).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    metrics["chi2_seq"] = b((2 * seq_log_rho).exp() - 1)


def mis_function(
    cfg: AlgoConfig,
    *,
    pg_loss: torch.Tensor,
    train_log_probs: torch.Tensor,
    rollout_log_probs: torch.Tensor,
    loss_mask: torch.Tensor,
    segments: Segments,
    mis: MisConfig | None = None,
    **_: Any,
) -> tuple[torch.Tensor, torch.Tensor, Metrics]:
    """MIS rollout correction configured by `--custom-config-path` (or `mis=` directly, for tests).

    Steps per sample: weights `exp(clamp(level log-ratio, ±20))` at `tis_level`; bounded by `tis_mode`
    (truncate: `min(w, upper)`; clip: `clamp(w, lower, upper)`; mask: tokens outside [lower, upper]
    leave the mask, weights unchanged); rejection sampling at `rs_level` removes tokens whose ratio is
    outside [rs_lower_bound, rs_upper_bound] from the mask, and `rs_veto_threshold` removes a whole
    sample when any token ratio is below it; `tis_batch_normalize` divides all weights by their mean
    over the batch (token level: over trained tokens; sequence level: over samples). Metrics are
    returned with the `mis_` prefix.
    """
    mis = mis if mis is not None else mis_config_for(cfg)
    metrics: Metrics = {}
    mask = loss_mask.to(torch.float32)
    train = train_log_probs.detach().to(torch.float32)
    rollout = rollout_log_probs.detach().to(torch.float32)
    _mismatch_metrics(train, rollout, mask, segments, metrics)
    if not mis.use_tis and not mis.use_rs:
        return pg_loss, mask, _prefixed(metrics)

    lower, upper = mis.resolved_tis_lower_bound, mis.tis_upper_bound
    raw = train - rollout
    new_mask = mask.clone()
    tis_log_ratio = _level_log_ratio(raw, mask, segments, mis.tis_level)
    if mis.use_tis:
        w = tis_log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()
        metrics["tis_weight_before_bound"] = w
        if mis.tis_mode == "truncate":
            metrics["tis_truncate_fraction"] = (w > upper).float()
            w = w.clamp(max=upper) * mask
        elif mis.tis_mode == "clip":
            metrics["tis_clip_fraction_low"] = (w < lower).float()
            metrics["tis_clip_fraction_high"] = (w > upper).float()
            w = w.clamp(lower, upper) * mask
        else:  # mask
            metrics["tis_mask_fraction_low"] = (w < lower).float()
            metrics["tis_mask_fraction_high"] = (w > upper).float()
            new_mask = new_mask * ((w >= lower) & (w <= upper)).float()
            w = w * mask
        metrics["tis_weight_after_bound"] = w
    else:
        w = mask.clone()
    if mis.use_rs:
        rs_log_ratio = tis_log_ratio if mis.rs_level == mis.tis_level else _level_log_ratio(raw, mask, segments, mis.rs_level)
        rs_w = rs_log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()
        rs_lower, rs_upper = mis.resolved_rs_lower_bound, mis.resolved_rs_upper_bound
        metrics["rs_mask_fraction_low"] = (rs_w < rs_lower).float()
        metrics["rs_mask_fraction_high"] = (rs_w > rs_upper).float()
        new_mask = new_mask * ((rs_w >= rs_lower) & (rs_w <= rs_upper)).float()
        if mis.rs_veto_threshold is not None:
            catastrophic = ((raw < torch.log(torch.tensor(mis.rs_veto_threshold))) & mask.bool()).float()
            vetoed = segments.broadcast(segments.sum(catastrophic) > 0).float()
            metrics["rs_catastrophic_token_fraction"] = catastrophic
            metrics["rs_catastrophic_seq_fraction"] = vetoed
            new_mask = new_mask * (1.0 - vetoed)
    metrics["is_ratio_mean_after_tis_rs"] = w

    if mis.tis_batch_normalize and mis.use_tis:
        if mis.tis_level == "token":
            mean = float(masked_sum(w, mask)) / max(float(mask.sum()), 1.0)
        else:  # sequence (geometric is rejected by MisConfig)
            mean = float(segment_masked_mean(w, mask, segments).sum()) / max(segments.num_segments, 1)
        factor = mean if mean > 1e-8 else 1.0
        w = w / factor
        metrics["batch_norm_factor"] = torch.full_like(w, factor)

    b = segments.broadcast
    metrics["is_ratio_mean_final"] = b(segment_masked_mean(w, mask, segments))
    metrics["is_ratio_min_final"] = b(_segment_extreme(w, mask, segments, largest=False))
    metrics["is_ratio_max_final"] = b(_segment_extreme(w, mask, segments, largest=True))
    return pg_loss * w, new_mask, _prefixed({k: v.detach() for k, v in metrics.items()})


def _prefixed(metrics: Metrics) -> Metrics:
    return {f"mis_{k}": v for k, v in metrics.items()}
