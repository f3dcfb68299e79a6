"""What the loss needs besides the training forward: old and reference log-probs, critic values,
advantages and returns, filled into every micro-batch of one rollout on this rank.

- old log-probs: the rollout engine's with `--use-rollout-logprobs`; with one optimizer step per
  rollout (and no `--kl-coef`), none at all: the weights do not change before the training forward,
  which runs the same micro-batches, so its detached log-probs ARE the old log-probs (bit for bit;
  `miles.train.loss.packed_loss` takes them) and a whole forward pass is saved; otherwise a no-grad
  forward of the actor before any update;
- reference log-probs: from the frozen reference model, when the backend loaded one (a KL term);
- teacher log-probs (`--use-opd`): the teacher engine's, carried in the train data (`--opd-type
  sglang`), else a no-grad forward of the trainer's teacher (`--opd-type megatron`); OPD also needs
  the old log-probs before the advantages, so it never reuses the training forward's;
- values: for estimators registered with `needs_values` (ppo), the critic's pre-update values of
  this rank's samples, which `train_critic` returned (`fill_value_inputs` computes them on the
  critic's own ranks, whose data-parallel layout is the actor's);
- advantages and returns of all this rank's samples in one vectorised call
  (`miles.algo.advantages`, with the OPD term of `miles.algo.opd`); `--normalize-advantages` whitens with statistics summed over the whole
  data-parallel group, so DP=N whitens exactly like DP=1.

No whole-groups requirement: group statistics were taken over whole groups on the rollout side and
every estimator works per sample, so a data-parallel rank may hold part of a group.
"""

from __future__ import annotations

from typing import Any

import torch

from miles.backends.base import PackedBatch, TrainerBackend


def fill_policy_inputs(
    backend: TrainerBackend,
    train_data: dict[str, Any],
    local: list[int],
    batches: list[PackedBatch],
    *,
    num_steps: int,
    reuse_on_policy_log_probs: bool = True,
    values: dict[int, torch.Tensor] | None = None,
) -> None:
    """Set old/ref log-probs, advantages and returns on `batches` (this rank's micro-batches of the
    rollout, in the order of `local`, their sample indices). `reuse_on_policy_log_probs=False` forces
    the separate no-grad forward even where the training forward's log-probs are the same numbers.
    `values`: sample index -> the critic's values [R_i] (ppo); None asks `backend.values`."""
    from miles.algo.advantages import NEEDS_VALUES

    algo = backend.cfg.algo
    opd = backend.cfg.opd.use_opd
    if algo.use_rollout_logprobs:
        if any(b.rollout_log_probs is None for b in batches):
            raise ValueError("--use-rollout-logprobs is set but the train data has no rollout_log_probs")
        for b in batches:
            b.old_log_probs = b.rollout_log_probs
    elif num_steps == 1 and algo.kl_coef == 0 and not opd and reuse_on_policy_log_probs:
        pass  # kl_coef and OPD need the old log-probs earlier, for the advantages
    else:
        for b, (lp, _) in zip(batches, backend.forward(batches, model="actor")):
            b.old_log_probs = lp
    if backend.has_reference:
        for b, (lp, _) in zip(batches, backend.forward(batches, model="ref")):
            b.ref_log_probs = lp
    if opd and any(b.teacher_log_probs is None for b in batches):
        if not backend.has_teacher:
            raise ValueError("--use-opd: the train data has no teacher_log_probs and this trainer loaded no teacher")
        for b, (lp, _) in zip(batches, backend.forward(batches, model="teacher")):
            b.teacher_log_probs = lp
    token_values = None
    if algo.advantage_estimator in NEEDS_VALUES and values is None:
        # No critic group sent values: the backend must be able to give them itself (a critic does).
        token_values = torch.cat(backend.values(batches))
    elif algo.advantage_estimator in NEEDS_VALUES:
        missing = [i for i in local if i not in values]
        if missing:
            raise ValueError(f"the critic sent no values for samples {missing[:5]} of this rank")
        token_values = torch.cat([values[i].to(backend.device, torch.float32) for i in local])
    fill_advantages(backend, train_data, local, batches, token_values)


def fill_value_inputs(
    backend: TrainerBackend, train_data: dict[str, Any], local: list[int], batches: list[PackedBatch]
) -> tuple[dict[int, torch.Tensor], dict[str, float]]:
    """On a critic's rank: its pre-update values of `batches` become their `old_values`, and GAE over
    them gives the value targets (`returns`), exactly as the actor will compute them from the same
    values. Returns (sample index -> values [R_i] on the CPU, for the actor) and the rollout's
    `critic/value_mean` and `critic/explained_variance` (1 - Var(R - V) / Var(R) over the trained
    tokens of the whole data-parallel group, before the update)."""
    per_batch = backend.values(batches)
    for b, v in zip(batches, per_batch):
        b.old_values = v
    fill_advantages(backend, train_data, local, batches, torch.cat(per_batch))
    flat = torch.cat(per_batch).cpu()
    by_sample = dict(zip(local, flat.split(torch.cat([b.response_lengths for b in batches]).tolist())))
    return by_sample, value_stats(backend, batches)


def value_stats(backend: TrainerBackend, batches: list[PackedBatch]) -> dict[str, float]:
    """`critic/value_mean` and `critic/explained_variance` of the old values against the returns."""
    from miles.algo.reduce import explained_variance_terms, explained_variance_from_terms

    mask = torch.cat([b.loss_mask for b in batches])
    terms = explained_variance_terms(torch.cat([b.old_values for b in batches]), torch.cat([b.returns for b in batches]), mask)
    if backend.dp_size > 1:
        terms = backend.all_reduce_dp(terms)
    return explained_variance_from_terms(terms)


def fill_advantages(
    backend: TrainerBackend, train_data: dict[str, Any], local: list[int], batches: list[PackedBatch], values: torch.Tensor | None
) -> None:
    """Advantages and returns of `batches` from their rewards (and old/ref log-probs, values)."""
    from miles.algo.advantages import compute_advantages_and_returns
    from miles.algo.segments import Segments

    algo = backend.cfg.algo

    def cat(name: str) -> torch.Tensor | None:
        return None if getattr(batches[0], name) is None else torch.cat([getattr(b, name) for b in batches])

    advantages, returns = compute_advantages_and_returns(
        algo,
        rewards=torch.tensor([float(train_data["rewards"][i]) for i in local], dtype=torch.float32, device=backend.device),
        loss_mask=torch.cat([b.loss_mask for b in batches]),
        segments=Segments.from_lengths(torch.cat([b.response_lengths for b in batches])),
        n_samples_per_prompt=backend.cfg.data.n_samples_per_prompt,
        log_probs=cat("old_log_probs"),
        ref_log_probs=cat("ref_log_probs"),
        values=values,
        all_reduce=backend.all_reduce_dp if backend.dp_size > 1 else None,
        teacher_log_probs=cat("teacher_log_probs") if backend.role == "actor" else None,  # the critic never sees OPD
        opd_kl_coef=backend.cfg.opd.opd_kl_coef,
    )
    sizes = [b.loss_mask.numel() for b in batches]
    for b, a, r in zip(batches, advantages.split(sizes), returns.split(sizes)):
        b.advantages, b.returns = a, r
