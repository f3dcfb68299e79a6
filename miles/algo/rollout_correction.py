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

    fn(cfg, *, pg_loss, train_log_probs, rollout_log_probs, loss_masks, **kwargs)
        -> (pg_loss, loss_masks, metrics)

with per-sample lists of 1-D tensors, and returns the weighted per-token losses, the (possibly
reduced) masks and `{name: list of per-token tensors}` metrics. The policy loss reduces those metrics
with the original masks, and reduces the loss with the returned masks but the original per-sample
token counts, so rejected tokens lower a sample's mean instead of being renormalised away.
Metric definitions are listed in docs/algorithms.md.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from typing import Any

import torch

from miles.algo.reduce import masked_mean, masked_sum
from miles.config.algo import AlgoConfig, MisConfig, load_mis_config

# Same safety bound as the policy ratio: exp(20) is huge but finite in float32.
LOG_RATIO_CLAMP = 20.0

Metrics = dict[str, list[torch.Tensor]]


def _append(metrics: Metrics, name: str, value: torch.Tensor) -> None:
    metrics.setdefault(name, []).append(value.detach().to(torch.float32))


def vanilla_tis(
    cfg: AlgoConfig,
    *,
    pg_loss: Sequence[torch.Tensor],
    train_log_probs: Sequence[torch.Tensor],
    rollout_log_probs: Sequence[torch.Tensor],
    loss_masks: Sequence[torch.Tensor],
    **_: Any,
) -> tuple[list[torch.Tensor], list[torch.Tensor], Metrics]:
    """Truncated importance sampling: `pg_t * clamp(rho_t, tis_clip_low, tis_clip)`; masks unchanged."""
    metrics: Metrics = {}
    out = []
    for pg, train, rollout in zip(pg_loss, train_log_probs, rollout_log_probs):
        log_rho = (train.detach() - rollout.detach()).to(torch.float32).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        rho = log_rho.exp()
        w = rho.clamp(cfg.tis_clip_low, cfg.tis_clip)
        _append(metrics, "tis", rho)
        _append(metrics, "tis_clipfrac", (w != rho).float())
        _append(metrics, "tis_abs", (rho - 1).abs())
        out.append(pg * w)
    return out, list(loss_masks), metrics


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


def _level_log_ratio(raw: torch.Tensor, mask: torch.Tensor, level: str) -> torch.Tensor:
    """Token log-ratios, or the sequence's sum (product of ratios) / mean (geometric mean) on every token."""
    if level == "token":
        return raw
    if level == "sequence":
        return masked_sum(raw, mask).expand_as(raw)
    if level == "geometric":
        return masked_mean(raw, mask).expand_as(raw)
    raise ValueError(f"unknown level {level!r}")


def _extreme(x: torch.Tensor, mask: torch.Tensor, *, largest: bool) -> torch.Tensor:
    picked = x[mask.bool()]
    if picked.numel() == 0:
        return x.new_zeros(())
    return picked.max() if largest else picked.min()


def _mismatch_metrics(train: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor, metrics: Metrics) -> None:
    """Perplexities, KL and chi-squared between the rollout and training distributions (per sample)."""
    mean_train = masked_mean(train, mask)
    mean_rollout = masked_mean(rollout, mask)
    ones = torch.ones_like(train)
    _append(metrics, "training_log_ppl", -mean_train * ones)
    _append(metrics, "training_ppl", (-mean_train).exp() * ones)
    _append(metrics, "rollout_log_ppl", -mean_rollout * ones)
    _append(metrics, "rollout_ppl", (-mean_rollout).exp() * ones)
    _append(metrics, "kl", rollout - train)
    log_rho = train - rollout
    _append(metrics, "k3_kl", log_rho.exp() - 1 - log_rho)
    log_ppl_diff = mean_rollout - mean_train
    _append(metrics, "log_ppl_diff", log_ppl_diff * ones)
    _append(metrics, "log_ppl_abs_diff", log_ppl_diff.abs() * ones)
    _append(metrics, "ppl_ratio", log_ppl_diff.exp() * ones)
    rho = log_rho.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()
    _append(metrics, "chi2_token", (masked_mean(rho.square(), mask) - 1) * ones)
    seq_log_rho = masked_sum(log_rho, mask).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    _append(metrics, "chi2_seq", ((2 * seq_log_rho).exp() - 1) * ones)


def mis_function(
    cfg: AlgoConfig,
    *,
    pg_loss: Sequence[torch.Tensor],
    train_log_probs: Sequence[torch.Tensor],
    rollout_log_probs: Sequence[torch.Tensor],
    loss_masks: Sequence[torch.Tensor],
    mis: MisConfig | None = None,
    **_: Any,
) -> tuple[list[torch.Tensor], list[torch.Tensor], Metrics]:
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
    masks = [m.to(torch.float32) for m in loss_masks]
    trains = [t.detach().to(torch.float32) for t in train_log_probs]
    rollouts = [r.detach().to(torch.float32) for r in rollout_log_probs]
    for train, rollout, mask in zip(trains, rollouts, masks):
        _mismatch_metrics(train, rollout, mask, metrics)
    if not mis.use_tis and not mis.use_rs:
        return list(pg_loss), masks, _prefixed(metrics)

    lower, upper = mis.resolved_tis_lower_bound, mis.tis_upper_bound
    weights: list[torch.Tensor] = []
    new_masks: list[torch.Tensor] = []
    for train, rollout, mask in zip(trains, rollouts, masks):
        raw = train - rollout
        new_mask = mask.clone()
        tis_log_ratio = _level_log_ratio(raw, mask, mis.tis_level)
        if mis.use_tis:
            w = tis_log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()
            _append(metrics, "tis_weight_before_bound", w)
            if mis.tis_mode == "truncate":
                _append(metrics, "tis_truncate_fraction", (w > upper).float())
                w = w.clamp(max=upper) * mask
            elif mis.tis_mode == "clip":
                _append(metrics, "tis_clip_fraction_low", (w < lower).float())
                _append(metrics, "tis_clip_fraction_high", (w > upper).float())
                w = w.clamp(lower, upper) * mask
            else:  # mask
                _append(metrics, "tis_mask_fraction_low", (w < lower).float())
                _append(metrics, "tis_mask_fraction_high", (w > upper).float())
                new_mask = new_mask * ((w >= lower) & (w <= upper)).float()
                w = w * mask
            _append(metrics, "tis_weight_after_bound", w)
        else:
            w = mask.clone()
        if mis.use_rs:
            rs_log_ratio = tis_log_ratio if mis.rs_level == mis.tis_level else _level_log_ratio(raw, mask, mis.rs_level)
            rs_w = rs_log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()
            rs_lower, rs_upper = mis.resolved_rs_lower_bound, mis.resolved_rs_upper_bound
            _append(metrics, "rs_mask_fraction_low", (rs_w < rs_lower).float())
            _append(metrics, "rs_mask_fraction_high", (rs_w > rs_upper).float())
            new_mask = new_mask * ((rs_w >= rs_lower) & (rs_w <= rs_upper)).float()
            if mis.rs_veto_threshold is not None:
                catastrophic = (raw < torch.log(torch.tensor(mis.rs_veto_threshold))) & mask.bool()
                vetoed = catastrophic.any()
                _append(metrics, "rs_catastrophic_token_fraction", catastrophic.float())
                _append(metrics, "rs_catastrophic_seq_fraction", vetoed.float().expand_as(mask))
                new_mask = new_mask * (~vetoed).float()
        _append(metrics, "is_ratio_mean_after_tis_rs", w)
        weights.append(w)
        new_masks.append(new_mask)

    if mis.tis_batch_normalize and mis.use_tis:
        if mis.tis_level == "token":
            count = sum(float(m.sum()) for m in masks)
            mean = sum(float(masked_sum(w, m)) for w, m in zip(weights, masks)) / max(count, 1.0)
        else:  # sequence (geometric is rejected by MisConfig)
            mean = sum(float(masked_mean(w, m)) for w, m in zip(weights, masks)) / max(len(weights), 1)
        factor = mean if mean > 1e-8 else 1.0
        weights = [w / factor for w in weights]
        for w in weights:
            _append(metrics, "batch_norm_factor", torch.full_like(w, factor))

    for w, m in zip(weights, masks):
        ones = torch.ones_like(w)
        _append(metrics, "is_ratio_mean_final", masked_mean(w, m) * ones)
        _append(metrics, "is_ratio_min_final", _extreme(w, m, largest=False) * ones)
        _append(metrics, "is_ratio_max_final", _extreme(w, m, largest=True) * ones)

    out = [pg * w for pg, w in zip(pg_loss, weights)]
    return out, new_masks, _prefixed(metrics)


def _prefixed(metrics: Metrics) -> Metrics:
    return {f"mis_{k}": v for k, v in metrics.items()}
