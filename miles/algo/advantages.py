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

Shapes: per-token inputs and outputs are packed [R] tensors over the response tokens of B samples,
with `Segments` naming each token's sample. Broadcasts and the last-token reward are segment
operations; the two recursions (discounted returns, GAE) step backwards over token positions,
vectorised over all samples at once (at most the longest response's trained-token count steps).
With data parallelism the trainer passes `all_reduce` (an in-place sum over the DP group) so that
`--normalize-advantages` whitens with the statistics of the whole global batch, not of one rank.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from miles.algo.kl import approx_kl
from miles.algo.opd import apply_opd
from miles.algo.segments import Segments
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


AllReduce = Callable[[torch.Tensor], torch.Tensor]
"""Sums a tensor in place over the data-parallel group and returns it."""


Estimator = Callable[..., tuple[torch.Tensor, torch.Tensor]]
"""`fn(cfg, *, rewards [B], kl [R], mask [R], segments, values [R] | None) -> (advantages [R], returns [R])`.

Inputs are detached float32; `kl` is the per-token KL (zeros unless `--kl-coef`). Whitening
(`--normalize-advantages`) is applied after the estimator, by `compute_advantages_and_returns`."""

ESTIMATORS: dict[str, Estimator] = {}
"""`--advantage-estimator` name -> estimator; filled by `@estimator`."""

NEEDS_VALUES: set[str] = set()
"""Estimators that read a critic's values (the RL step asks the backend for them)."""


def estimator(*names: str, needs_values: bool = False) -> Callable[[Estimator], Estimator]:
    """Register an advantage estimator under one or more `--advantage-estimator` names.

    Adding an estimator is this decorator on one function here plus its name in
    `miles.config.algo.AdvantageEstimator` (and, if its rewards are group-centred on the rollout side,
    in `GROUP_BASELINE_ESTIMATORS`). `needs_values`: the RL step fetches critic values for it.
    """

    def register(fn: Estimator) -> Estimator:
        for name in names:
            if name in ESTIMATORS:
                raise ValueError(f"advantage estimator {name!r} is registered twice")
            ESTIMATORS[name] = fn
            if needs_values:
                NEEDS_VALUES.add(name)
        return fn

    return register


def compute_advantages_and_returns(
    cfg: AlgoConfig,
    *,
    rewards: torch.Tensor,
    loss_mask: torch.Tensor,
    segments: Segments,
    n_samples_per_prompt: int,
    log_probs: torch.Tensor | None = None,
    ref_log_probs: torch.Tensor | None = None,
    values: torch.Tensor | None = None,
    all_reduce: AllReduce | None = None,
    teacher_log_probs: torch.Tensor | None = None,
    opd_kl_coef: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token advantages and returns [R] for `cfg.advantage_estimator` (see the module docstring).

    `rewards` holds one scalar per sample ([B]), already group-normalised by train_data for grpo,
    gspo and reinforce_plus_plus_baseline. Nothing here carries gradient: inputs are detached.

    `all_reduce` sums a float64 tensor over the data-parallel group (in place like
    `torch.distributed.all_reduce`, or returning the sum); `--normalize-advantages` whitens with
    statistics over the whole group through it. None means this process holds the whole rollout.
    `teacher_log_probs` (`--use-opd`): the teacher's log-probs of the same tokens; the reverse KL
    against `log_probs` (the old student log-probs), times `opd_kl_coef`, is subtracted from the
    advantages before whitening (`miles.algo.opd`); the returns (the critic's targets) never see it.
    The group statistics are taken on the rollout side over whole groups and every estimator here
    works per sample, so the samples need not form whole groups of `n_samples_per_prompt` (a
    data-parallel rank may hold part of a group); the argument is kept for interface stability.
    """
    n = segments.num_segments
    if rewards.numel() != n:
        raise ValueError(f"{rewards.numel()} rewards for {n} samples")
    mask = loss_mask.detach().to(torch.float32)
    rewards = rewards.detach().to(torch.float32).reshape(-1).to(mask.device)
    kl = _token_kl(cfg, mask, log_probs, ref_log_probs)
    fn = ESTIMATORS.get(cfg.advantage_estimator)
    if fn is None:
        raise ValueError(f"unknown advantage estimator {cfg.advantage_estimator!r}")
    advantages, returns = fn(
        cfg, rewards=rewards, kl=kl, mask=mask, segments=segments,
        values=None if values is None else values.detach().to(torch.float32),
    )
    if teacher_log_probs is not None:
        if log_probs is None:
            raise ValueError("on-policy distillation needs the student's old log-probs of the tokens its teacher scored")
        advantages = apply_opd(
            advantages, student_log_probs=log_probs, teacher_log_probs=teacher_log_probs.to(mask.device), mask=mask, kl_coef=opd_kl_coef
        )
    if cfg.normalize_advantages:
        advantages = whiten(advantages, mask, all_reduce=all_reduce)
    return advantages, returns


@estimator("grpo", "gspo")
def _group_normalized_reward(cfg, *, rewards, kl, mask, segments, values):
    """The (already group-normalised) reward on every trained token."""
    advantages = segments.broadcast(rewards) * mask
    return advantages, advantages.clone()


@estimator("reinforce_plus_plus_baseline")
def _reinforce_plus_plus_baseline(cfg, *, rewards, kl, mask, segments, values):
    advantages = (segments.broadcast(rewards) - cfg.kl_coef * kl) * mask
    return advantages, advantages.clone()


@estimator("reinforce_plus_plus")
def _reinforce_plus_plus(cfg, *, rewards, kl, mask, segments, values):
    token_rewards = _token_rewards(cfg, rewards, kl, mask, segments)
    advantages = _discounted_returns(token_rewards, mask, segments, gamma=cfg.gamma)
    return advantages, advantages.clone()


@estimator("ppo", needs_values=True)
def _ppo(cfg, *, rewards, kl, mask, segments, values):
    if values is None:
        raise ValueError("the ppo estimator needs the critic's values")
    token_rewards = _token_rewards(cfg, rewards, kl, mask, segments)
    return gae(token_rewards, values, mask, segments, gamma=cfg.gamma, lambd=cfg.lambd)


def _token_kl(
    cfg: AlgoConfig, mask: torch.Tensor, log_probs: torch.Tensor | None, ref_log_probs: torch.Tensor | None
) -> torch.Tensor:
    if cfg.kl_coef == 0:
        return torch.zeros_like(mask)
    if log_probs is None or ref_log_probs is None:
        raise ValueError("--kl-coef needs log_probs and ref_log_probs (a reference model)")
    return approx_kl(log_probs.detach(), ref_log_probs.detach(), cfg.kl_loss_type).to(torch.float32) * mask


def _token_rewards(
    cfg: AlgoConfig, rewards: torch.Tensor, kl: torch.Tensor, mask: torch.Tensor, segments: Segments
) -> torch.Tensor:
    """`-kl_coef * kl_t` on trained tokens, plus the sample's reward on its last trained token."""
    out = -cfg.kl_coef * kl * mask
    positions = torch.arange(mask.numel(), device=mask.device)
    last = segments.amax(torch.where(mask > 0, positions, -1), empty=-1)  # [B]; -1: nothing trained
    has = last >= 0
    return out.index_add(0, last[has], rewards[has])


def _to_grid(x: torch.Tensor, mask: torch.Tensor, segments: Segments) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """The trained tokens of each sample, left-aligned in a zero-padded [B, K_max] grid (one scatter)."""
    trained = mask > 0
    rows = segments.index[trained]
    cols = segments.rank_in_segment(mask)[trained]
    k_max = int(cols.max()) + 1 if cols.numel() else 0
    grid = x.new_zeros((segments.num_segments, k_max))
    grid[rows, cols] = x[trained]
    return grid, (trained, rows, cols)


def _from_grid(grid: torch.Tensor, where: tuple[torch.Tensor, ...], like: torch.Tensor) -> torch.Tensor:
    trained, rows, cols = where
    out = torch.zeros_like(like)
    out[trained] = grid[rows, cols]
    return out


def _discounted_returns(token_rewards: torch.Tensor, mask: torch.Tensor, segments: Segments, *, gamma: float) -> torch.Tensor:
    """`G_t = r_t + gamma * G_{t+1}` over the trained tokens of each sample (batched over samples)."""
    r, where = _to_grid(token_rewards, mask, segments)
    out = torch.zeros_like(r)
    running = r.new_zeros(r.shape[0])
    # Zero padding after the last trained token keeps `running` at 0 until the real tokens start.
    for t in range(r.shape[1] - 1, -1, -1):
        running = r[:, t] + gamma * running
        out[:, t] = running
    return _from_grid(out, where, token_rewards)


def gae(
    token_rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    segments: Segments,
    *,
    gamma: float,
    lambd: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over the trained tokens of each sample; V after the last is 0."""
    r, where = _to_grid(token_rewards, mask, segments)
    v, _ = _to_grid(values, mask, segments)
    adv = torch.zeros_like(r)
    last = r.new_zeros(r.shape[0])
    k = r.shape[1]
    for t in range(k - 1, -1, -1):
        # Padding holds V = 0 and r = 0, so a sample's last trained token bootstraps from 0.
        next_v = v[:, t + 1] if t + 1 < k else r.new_zeros(r.shape[0])
        delta = r[:, t] + gamma * next_v - v[:, t]
        last = delta + gamma * lambd * last
        adv[:, t] = last
    return _from_grid(adv, where, token_rewards), _from_grid(adv + v, where, token_rewards)


def _summed(all_reduce: AllReduce, t: torch.Tensor) -> torch.Tensor:
    """`t` summed over the group, whether `all_reduce` works in place (torch.distributed) or returns the sum."""
    out = all_reduce(t)
    return out if isinstance(out, torch.Tensor) else t


def whiten(
    advantages: torch.Tensor, mask: torch.Tensor, *, eps: float = WHITEN_EPS, all_reduce: AllReduce | None = None
) -> torch.Tensor:
    """`(A - mean) / sqrt(var + eps)` with mean and (Bessel-corrected) var over all trained tokens.

    With `all_reduce`, count, sum and squared deviations are summed over the data-parallel group
    first, so every rank whitens with the global batch's statistics. Masked positions stay 0. With no
    trained token at all the advantages are returned unchanged.
    """
    m = mask.to(torch.float64)
    a = advantages.to(torch.float64)
    stats = torch.stack([m.sum(), (a * m).sum()])
    if all_reduce is not None:
        stats = _summed(all_reduce, stats)
    count, total = float(stats[0]), float(stats[1])
    if count == 0:
        return advantages.clone()
    mean = total / count
    sq = (((a - mean) * m) ** 2).sum().reshape(1)
    if all_reduce is not None:
        sq = _summed(all_reduce, sq)
    var = float(sq) / (count - 1) if count >= 2 else float(sq) / count
    scale = (var + eps) ** -0.5
    return (advantages - mean) * scale * mask
