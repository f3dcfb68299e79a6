"""Advantage estimators: from per-sample rewards (and values, KL) to per-token advantages and returns.

Two steps, split as upstream miles splits them:

1. `normalize_group_rewards` (called by `miles.rollout.train_data.samples_to_train_data` when the
   rollout is turned into train data): for grpo, gspo and reinforce_plus_plus_baseline each reward
   becomes `r - mean(group)`, and for grpo/gspo is divided by `std(group) + 1e-6` (Bessel-corrected
   std; skipped with `--disable-grpo-std-normalization` or when a group has one sample).
2. `compute_advantages_and_returns` (called by the trainer, which has log-probs and values):

   - grpo, gspo: `A_t = r` on every trained token; returns = advantages;
   - reinforce_plus_plus_baseline: `A_t = r - kl_coef * kl_t`; returns = advantages;
   - reinforce_plus_plus: token rewards `-kl_coef * kl_t` plus the raw reward at the last trained
     token, discounted: `G_t = r_t + gamma * G_{t+1}`; advantages = returns = G;
   - ppo: the same token rewards, GAE: `delta_t = r_t + gamma V_{t+1} - V_t` (V after the last trained
     token is 0, also for truncated responses), `A_t = delta_t + gamma lambd A_{t+1}`, returns `A + V`;
   - `--normalize-advantages`: whiten advantages over all trained tokens of the rollout; with data
     parallelism the count, sum and sum of squares are summed over the DP group (`all_reduce`), so
     every rank uses the same mean and std and DP=N equals DP=1.

Masked tokens (loss mask 0: tool output, removed samples) are not steps of the decision process:
the recursions run over the trained tokens only, so masked tokens neither receive reward nor get
discounted over (upstream discounts over them in reinforce_plus_plus; we treat both estimators
alike). Advantages and returns are exactly 0 at masked positions, and a sample with no trained
token (an empty response) gets empty/zero tensors, never NaN.

`kl_t` is `approx_kl(log_probs, ref_log_probs, --kl-loss-type)` and is computed only when
`--kl-coef` is non-zero. Formulas: docs/algorithms.md.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from miles.algo.kl import approx_kl
from miles.config.algo import AlgoConfig

GROUP_STD_EPS = 1e-6
WHITEN_EPS = 1e-8

AllReduce = Callable[[torch.Tensor], object]
"""Sums a tensor in place over the data-parallel group (the signature of `torch.distributed.all_reduce`)."""


def normalize_group_rewards(
    rewards: torch.Tensor,
    n_samples_per_prompt: int,
    *,
    subtract_mean: bool = True,
    std_normalization: bool = True,
    eps: float = GROUP_STD_EPS,
) -> torch.Tensor:
    """Normalise rewards within consecutive groups of `n_samples_per_prompt` (one group per prompt).

    Returns `(r - mean) / (std + eps)` per group, with the std (Bessel-corrected) division skipped when
    `std_normalization` is false or the group has a single sample. A group whose rewards are all
    equal becomes all zeros.
    """
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D, got shape {tuple(rewards.shape)}")
    if n_samples_per_prompt < 1 or rewards.numel() % n_samples_per_prompt:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {n_samples_per_prompt}")
    groups = rewards.to(torch.promote_types(rewards.dtype, torch.float32)).reshape(-1, n_samples_per_prompt)
    if subtract_mean:
        groups = groups - groups.mean(dim=-1, keepdim=True)
    if std_normalization and n_samples_per_prompt > 1:
        groups = groups / (groups.std(dim=-1, keepdim=True) + eps)
    return groups.reshape(-1)


def compute_advantages_and_returns(
    cfg: AlgoConfig,
    *,
    rewards: torch.Tensor,
    loss_masks: Sequence[torch.Tensor],
    n_samples_per_prompt: int,
    log_probs: Sequence[torch.Tensor] | None = None,
    ref_log_probs: Sequence[torch.Tensor] | None = None,
    values: Sequence[torch.Tensor] | None = None,
    all_reduce: AllReduce | None = None,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per-token advantages and returns for `cfg.advantage_estimator` (see the module docstring).

    `all_reduce` sums a float64 tensor in place over the data-parallel group (e.g.
    `torch.distributed.all_reduce`); `--normalize-advantages` whitens with statistics over the whole
    group through it. None means this process holds the whole rollout.

    `rewards` holds one scalar per sample, already group-normalised by train_data for grpo, gspo and
    reinforce_plus_plus_baseline. Nothing here carries gradient: inputs are detached. The group
    statistics are taken on the rollout side over whole groups and every estimator here works per
    sample, so the samples need not form whole groups of `n_samples_per_prompt` (a data-parallel rank
    may hold part of a group); the argument is accepted for interface stability.
    """
    n = len(loss_masks)
    if rewards.numel() != n:
        raise ValueError(f"{rewards.numel()} rewards for {n} samples")
    masks = [m.detach().to(torch.float32) for m in loss_masks]
    rewards = rewards.detach().to(torch.float32).reshape(-1)
    kl = _token_kl(cfg, masks, log_probs, ref_log_probs)
    estimator = cfg.advantage_estimator

    if estimator in ("grpo", "gspo"):
        advantages = [rewards[i] * m for i, m in enumerate(masks)]
        returns = [a.clone() for a in advantages]
    elif estimator == "reinforce_plus_plus_baseline":
        advantages = [(rewards[i] - cfg.kl_coef * kl[i]) * m for i, m in enumerate(masks)]
        returns = [a.clone() for a in advantages]
    elif estimator == "reinforce_plus_plus":
        token_rewards = _token_rewards(cfg, rewards, kl, masks)
        advantages = _discounted_returns(token_rewards, masks, gamma=cfg.gamma)
        returns = [a.clone() for a in advantages]
    elif estimator == "ppo":
        if values is None:
            raise ValueError("the ppo estimator needs the critic's values")
        token_rewards = _token_rewards(cfg, rewards, kl, masks)
        advantages, returns = gae(
            token_rewards, [v.detach().to(torch.float32) for v in values], masks, gamma=cfg.gamma, lambd=cfg.lambd
        )
    else:
        raise ValueError(f"unknown advantage estimator {estimator!r}")

    if cfg.normalize_advantages:
        advantages = whiten(advantages, masks, all_reduce=all_reduce)
    return advantages, returns


def _token_kl(
    cfg: AlgoConfig,
    masks: list[torch.Tensor],
    log_probs: Sequence[torch.Tensor] | None,
    ref_log_probs: Sequence[torch.Tensor] | None,
) -> list[torch.Tensor]:
    if cfg.kl_coef == 0:
        return [torch.zeros_like(m) for m in masks]
    if log_probs is None or ref_log_probs is None:
        raise ValueError("--kl-coef needs log_probs and ref_log_probs (a reference model)")
    return [
        approx_kl(lp.detach(), ref.detach(), cfg.kl_loss_type).to(torch.float32) * m
        for lp, ref, m in zip(log_probs, ref_log_probs, masks)
    ]


def _token_rewards(
    cfg: AlgoConfig, rewards: torch.Tensor, kl: list[torch.Tensor], masks: list[torch.Tensor]
) -> list[torch.Tensor]:
    """`-kl_coef * kl_t` on trained tokens, plus the sample's reward on its last trained token."""
    out = []
    for i, m in enumerate(masks):
        r = -cfg.kl_coef * kl[i] * m
        trained = m.nonzero(as_tuple=True)[0]
        if trained.numel():
            r[trained[-1]] += rewards[i]
        out.append(r)
    return out


def _pack(tensors: Sequence[torch.Tensor], masks: Sequence[torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Gather each sample's trained positions into a zero-padded [B, K_max] matrix."""
    idx = [m.nonzero(as_tuple=True)[0] for m in masks]
    k_max = max((i.numel() for i in idx), default=0)
    packed = torch.zeros(len(tensors), k_max)
    for b, (t, ix) in enumerate(zip(tensors, idx)):
        packed[b, : ix.numel()] = t[ix]
    return packed, idx


def _unpack(packed: torch.Tensor, idx: list[torch.Tensor], masks: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    out = []
    for b, (ix, m) in enumerate(zip(idx, masks)):
        full = torch.zeros_like(m)
        full[ix] = packed[b, : ix.numel()]
        out.append(full)
    return out


def _discounted_returns(token_rewards: list[torch.Tensor], masks: list[torch.Tensor], *, gamma: float) -> list[torch.Tensor]:
    """`G_t = r_t + gamma * G_{t+1}` over the trained tokens of each sample (batched over samples)."""
    packed, idx = _pack(token_rewards, masks)
    out = torch.zeros_like(packed)
    running = torch.zeros(packed.shape[0])
    # Zero padding after the last trained token keeps `running` at 0 until the real tokens start.
    for t in range(packed.shape[1] - 1, -1, -1):
        running = packed[:, t] + gamma * running
        out[:, t] = running
    return _unpack(out, idx, masks)


def gae(
    token_rewards: Sequence[torch.Tensor],
    values: Sequence[torch.Tensor],
    masks: Sequence[torch.Tensor],
    *,
    gamma: float,
    lambd: float,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Generalised advantage estimation over the trained tokens of each sample; V after the last is 0."""
    r, idx = _pack(token_rewards, masks)
    v, _ = _pack(values, masks)
    adv = torch.zeros_like(r)
    last = torch.zeros(r.shape[0])
    k = r.shape[1]
    for t in range(k - 1, -1, -1):
        # Padding holds V = 0 and r = 0, so a sample's last trained token bootstraps from 0.
        next_v = v[:, t + 1] if t + 1 < k else torch.zeros(r.shape[0])
        delta = r[:, t] + gamma * next_v - v[:, t]
        last = delta + gamma * lambd * last
        adv[:, t] = last
    # Padded entries stay 0 in both: adv is 0 there by construction of the recursion from zeros.
    return _unpack(adv, idx, masks), _unpack(adv + v, idx, masks)


def whiten(
    advantages: Sequence[torch.Tensor],
    masks: Sequence[torch.Tensor],
    *,
    eps: float = WHITEN_EPS,
    all_reduce: AllReduce | None = None,
) -> list[torch.Tensor]:
    """`(A - mean) / sqrt(var + eps)` with mean and (Bessel-corrected) var over all trained tokens.

    With `all_reduce` the tokens are those of every data-parallel rank: the token count and sum, then
    the sum of squared deviations, are summed over the group (two float64 collectives; every rank
    must call this). Masked positions stay 0. With no trained token at all the advantages are
    returned unchanged.
    """
    stats = torch.tensor(
        [sum(float(m.sum()) for m in masks), sum(float((a * m).sum()) for a, m in zip(advantages, masks))],
        dtype=torch.float64,
    )
    if all_reduce is not None:
        all_reduce(stats)
    count, total = float(stats[0]), float(stats[1])
    if count == 0:
        return [a.clone() for a in advantages]
    mean = total / count
    sq = torch.tensor([sum(float((((a - mean) * m) ** 2).sum()) for a, m in zip(advantages, masks))], dtype=torch.float64)
    if all_reduce is not None:
        all_reduce(sq)
    var = float(sq[0]) / (count - 1) if count >= 2 else float(sq[0]) / count
    scale = (var + eps) ** -0.5
    return [(a - mean) * scale * m for a, m in zip(advantages, masks)]
