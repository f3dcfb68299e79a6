"""The training losses: PPO/GSPO policy loss, SFT loss, PPO value loss, and `get_loss_function`.

Inputs are packed: flat [R] tensors over the response tokens of B samples (`log_probs` carries
gradient; the rest are data), a 0/1 [R] `loss_mask`, and `segments` (`miles.algo.segments.Segments`)
saying which tokens belong to which sample. Every per-sample quantity (GSPO's sequence ratio, the
per-sample mean) is a segment reduction; nothing loops over samples. Each loss returns
`(loss, metrics)`: a scalar with gradient, reduced by `miles.algo.reduce.reduce_batch` (per-sample
mean, or per-token sum with `--calculate-per-token-loss`, divided by `normalizer`; see there), and a
dict of detached 0-d tensors with stable names. Averaged metrics are reduced exactly like the loss, so
a trainer that sums them over the micro-batches of one step (passing the step's `normalizer`) gets
the step's mean; `ratio_max`/`ratio_min` are this call's max/min (combine with max/min).

`policy_loss` metrics:

- `loss`: the returned loss; `pg_loss`: the clipped surrogate; `pg_clipfrac`: fraction of tokens
  where the clipped term was taken; `ppo_kl`: mean of `old_logp - logp` (GSPO: per-sample mean);
- `ratio_mean`, `ratio_max`, `ratio_min`: the PPO ratio `exp(logp - old_logp)` (GSPO: sequence ratio);
- `approx_kl`: k3 estimate of KL(old || new), `mean(exp(logp - old) - 1 - (logp - old))`;
- `entropy_loss`: mean token entropy (0 when no entropy is passed); `kl_loss` (with `--use-kl-loss`):
  mean `approx_kl(logp, ref_logp, --kl-loss-type)`;
- with rollout log-probs: `train_rollout_logprob_abs_diff` (mean |old_logp - rollout_logp|) and
  `train_rollout_kl` (mean low_var_kl of rollout vs train);
- with `--use-tis`: the correction's metrics (`tis`, `tis_clipfrac`, `tis_abs`; or the `mis_*` set).

`value_loss` metrics: `value_loss`, `value_clipfrac`. `sft_loss` metrics: `loss`.
All formulas: docs/algorithms.md.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from miles.algo.kl import approx_kl
from miles.algo.reduce import masked_extreme, reduce_batch, segment_masked_mean
from miles.algo.rollout_correction import vanilla_tis
from miles.algo.segments import Segments
from miles.config.algo import AlgoConfig
from miles.errors import UserError
from miles.utils.load_function import load_function

LossFn = Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]

LOG_RATIO_CLAMP = 20.0


def _clean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Zero `x` outside the mask and wherever it is NaN/inf (a garbage token must not poison the batch)."""
    return torch.where(mask.bool(), torch.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0), torch.zeros_like(x))


def clipped_surrogate(
    ppo_kl: torch.Tensor,
    advantages: torch.Tensor,
    *,
    eps_clip: float,
    eps_clip_high: float,
    eps_clip_c: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token PPO loss `max(-rho A, -clip(rho, 1-eps, 1+eps_high) A)` with optional dual clip.

    `ppo_kl = old_logp - logp`, so `rho = exp(-ppo_kl)` (log-ratio clamped to ±20). Returns
    `(loss, clipped, rho)` where `clipped` is 1 where the clipped term is strictly larger.
    """
    ratio = (-ppo_kl).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()
    unclipped = -ratio * advantages
    clipped = -ratio.clamp(1.0 - eps_clip, 1.0 + eps_clip_high) * advantages
    loss = torch.maximum(unclipped, clipped)
    clipfrac = (clipped > unclipped).float()
    if eps_clip_c is not None:
        # Dual clip: for A < 0 a huge ratio would make the loss unbounded; cap it at -c * A.
        loss = torch.where(advantages < 0, torch.minimum(loss, -eps_clip_c * advantages), loss)
    return loss, clipfrac, ratio


def _eps_clip_high(cfg: AlgoConfig) -> float:
    if cfg.eps_clip_high is None:
        raise ValueError("cfg.eps_clip_high is unset: resolve() fills it (default: --eps-clip) before training")
    return cfg.eps_clip_high


def policy_loss(
    cfg: AlgoConfig,
    *,
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    segments: Segments,
    ref_log_probs: torch.Tensor | None = None,
    rollout_log_probs: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    normalizer: float | torch.Tensor | None = None,
    **_: Any,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate (GSPO: sequence-level ratio) + entropy bonus + KL loss + rollout correction."""
    per_token = cfg.calculate_per_token_loss
    mask = loss_mask.to(torch.float32)
    old = old_log_probs.detach()

    if cfg.advantage_estimator == "gspo":
        # Sequence ratio = geometric mean of token ratios = exp(mean log-ratio); gradient flows to every token.
        ppo_kl = segments.broadcast(segment_masked_mean(old - log_probs, mask, segments))
    else:
        ppo_kl = old - log_probs
    ppo_kl = _clean(ppo_kl, mask)
    adv = _clean(advantages.detach().to(torch.float32), mask)
    pg, clipfrac, ratio = clipped_surrogate(
        ppo_kl, adv, eps_clip=cfg.eps_clip, eps_clip_high=_eps_clip_high(cfg), eps_clip_c=cfg.eps_clip_c
    )

    def reduce(values: torch.Tensor) -> torch.Tensor:
        return reduce_batch(values, mask, segments, per_token=per_token, normalizer=normalizer)

    correction_metrics: dict[str, torch.Tensor] = {}
    pg_mask, denominators = mask, None
    if cfg.use_tis:
        if rollout_log_probs is None:
            raise ValueError("--use-tis needs the rollout log-probs of every sample")
        correct = (
            load_function(cfg.custom_tis_function_path, flag="--custom-tis-function-path")
            if cfg.custom_tis_function_path
            else vanilla_tis
        )
        pg, pg_mask, correction_metrics = correct(
            cfg, pg_loss=pg, train_log_probs=old, rollout_log_probs=rollout_log_probs, loss_mask=mask, segments=segments
        )
        pg_mask = pg_mask.to(torch.float32)
        denominators = segments.sum(mask)
    pg_loss = reduce_batch(pg, pg_mask, segments, per_token=per_token, normalizer=normalizer, denominators=denominators)

    loss = pg_loss
    if entropy is not None:
        entropy_loss = reduce(entropy)
    elif cfg.entropy_coef != 0:
        raise ValueError("--entropy-coef is non-zero but no entropy was passed to policy_loss")
    else:
        entropy_loss = pg_loss.new_zeros(())
    if cfg.entropy_coef != 0:
        loss = loss - cfg.entropy_coef * entropy_loss

    metrics: dict[str, torch.Tensor] = {}
    if cfg.use_kl_loss:
        if ref_log_probs is None:
            raise ValueError("--use-kl-loss needs the reference model's log-probs")
        ir = (log_probs - old).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp() if cfg.use_unbiased_kl else None
        kl_loss = reduce(_clean(approx_kl(log_probs, ref_log_probs.detach(), cfg.kl_loss_type, importance_ratio=ir), mask))
        loss = loss + cfg.kl_loss_coef * kl_loss
        metrics["kl_loss"] = kl_loss.detach()

    with torch.no_grad():
        lp = log_probs.detach()
        metrics.update(
            loss=loss.detach(),
            pg_loss=pg_loss.detach(),
            entropy_loss=entropy_loss.detach(),
            pg_clipfrac=reduce(clipfrac),
            ppo_kl=reduce(ppo_kl.detach()),
            approx_kl=reduce(_clean(approx_kl(old, lp, "k3"), mask)),
            ratio_mean=reduce(ratio.detach()),
            ratio_max=masked_extreme(ratio, mask, largest=True),
            ratio_min=masked_extreme(ratio, mask, largest=False),
        )
        if rollout_log_probs is not None:
            rollout = rollout_log_probs.detach()
            metrics["train_rollout_logprob_abs_diff"] = reduce(_clean((old - rollout).abs(), mask))
            metrics["train_rollout_kl"] = reduce(_clean(approx_kl(rollout, old, "low_var_kl"), mask))
        for name, values in correction_metrics.items():
            # A per-token [R] metric is reduced like the loss; a 0-d one is already the batch's value.
            metrics[name] = values.detach() if values.dim() == 0 else reduce(values.detach())
    return loss, metrics


def sft_loss(
    cfg: AlgoConfig,
    *,
    log_probs: torch.Tensor,
    loss_mask: torch.Tensor,
    segments: Segments,
    normalizer: float | torch.Tensor | None = None,
    **_: Any,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Negative log-likelihood of the response tokens, reduced like the policy loss."""
    mask = loss_mask.to(torch.float32)
    loss = -reduce_batch(log_probs, mask, segments, per_token=cfg.calculate_per_token_loss, normalizer=normalizer)
    return loss, {"loss": loss.detach()}


def value_loss(
    cfg: AlgoConfig,
    *,
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    loss_mask: torch.Tensor,
    segments: Segments,
    normalizer: float | torch.Tensor | None = None,
    **_: Any,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO value loss `max((V - R)^2, (V_old + clip(V - V_old, ±value_clip) - R)^2)` (no 1/2 factor)."""
    mask = loss_mask.to(torch.float32)
    per_token = cfg.calculate_per_token_loss
    v_old, ret = old_values.detach(), returns.detach()
    v_clipped = v_old + (values - v_old).clamp(-cfg.value_clip, cfg.value_clip)
    losses = torch.maximum((values - ret) ** 2, (v_clipped - ret) ** 2)
    clipfrac = ((values.detach() - v_old).abs() > cfg.value_clip).float()
    loss = reduce_batch(losses, mask, segments, per_token=per_token, normalizer=normalizer)
    frac = reduce_batch(clipfrac, mask, segments, per_token=per_token, normalizer=normalizer)
    return loss, {"value_loss": loss.detach(), "value_clipfrac": frac}


def get_loss_function(cfg: AlgoConfig, *, critic: bool = False) -> LossFn:
    """The loss for `--loss-type` (`value_loss` for the critic). Every loss takes the policy_loss keywords.

    A custom loss (`--custom-loss-function-path`) is called exactly like `policy_loss`, with packed
    [R] tensors and the `Segments` of their samples:
    `fn(cfg, *, log_probs, old_log_probs, advantages, loss_mask, segments, ref_log_probs, rollout_log_probs, entropy, normalizer, **kwargs) -> (loss, metrics)`.
    """
    if critic:
        return value_loss
    if cfg.loss_type == "policy_loss":
        return policy_loss
    if cfg.loss_type == "sft_loss":
        return sft_loss
    if cfg.loss_type == "custom_loss":
        fn = load_function(cfg.custom_loss_function_path, flag="--custom-loss-function-path")
        if fn is None:
            raise ValueError("--loss-type custom_loss without --custom-loss-function-path (AlgoConfig.check rejects this)")
        if not callable(fn):
            raise UserError(
                f"--custom-loss-function-path {cfg.custom_loss_function_path} is not a function; point it at a callable.",
                option="--custom-loss-function-path",
            )
        return fn
    raise ValueError(f"unknown loss type {cfg.loss_type!r}")

