"""The RL step, once for every trainer: one rollout's optimizer steps on one rank, through the
`TrainerBackend` primitives (miles/backends/base.py).

What `train_rollout(backend, train_data, rollout_id=...)` does, in upstream miles' order:

1. cut the rollout into `--num-steps-per-rollout` optimizer steps of `--global-batch-size` samples;
   this data-parallel rank takes its share of each step, in micro-batches of `--micro-batch-size`
   samples or, with `--use-dynamic-batch-size`, of at most `--max-tokens-per-gpu` tokens, balanced
   over the ranks by length (`batching.plan_steps`),
   each packed once into a `PackedBatch` (`packing.pack_samples`);
2. old/reference log-probs, critic values, advantages and returns (`inputs.fill_policy_inputs`; not
   for `--loss-type sft_loss`). All log-probs are of `logits / --rollout-temperature`, as the rollout
   engine scores them;
3. per step: `backend.forward_backward` of every micro-batch with the configured loss
   (`loss.packed_loss`), each micro-batch's loss divided by the whole global batch's sample count
   (or trained-token count with `--calculate-per-token-loss`), so the accumulated gradient is the
   gradient of the global batch's mean loss however the batch is cut; then
   `backend.optimizer_step(lr)` at the schedule's lr (`lr_schedule.lr_at`), and the step's metrics
   reduced over data parallelism (`backend.all_reduce_metrics`);
4. the rollout's metrics: the mean over its steps (`metrics.reduce_over_steps`) plus `perf/*`.

Every DP rank is given the same full `train_data` (`tokens`, `response_lengths`, `rewards` already
normalised per sample, `loss_masks`, optionally `rollout_log_probs`) and trains on its own shard.

PPO's critic is a second use of the same step (`train_critic`): the same plan, packing and
optimizer-step loop on the critic's backend (`role="critic"`), with its pre-update values as the
inputs (`inputs.fill_value_inputs`: old values, GAE returns), the value loss (`--value-clip`) and its
own lr schedule (`--critic-lr`, `--critic-lr-warmup-iters`); it returns the values it computed,
which the actor's step takes for its GAE (`train_rollout(..., values=...)`), so the critic's forward
runs once per rollout and no gradient can pass between the two models.

Use: `metrics = train_rollout(backend, train_data, rollout_id=0)`;
PPO: `metrics, values = train_critic(critic, train_data, rollout_id=0)`, then
`train_rollout(actor, train_data, rollout_id=0, values=values)`.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable

import torch

from miles.backends.base import PackedBatch, TrainerBackend
from miles.train.batching import StepPlan, plan_steps
from miles.train.inputs import fill_policy_inputs, fill_value_inputs
from miles.train.loss import loss_normalizer, packed_loss, packed_value_loss
from miles.train.lr_schedule import lr_at
from miles.train.metrics import combine_metric, perf_metrics, reduce_over_steps
from miles.train.packing import pack_samples

TrainData = dict[str, Any]


def train_rollout(
    backend: TrainerBackend,
    train_data: TrainData,
    *,
    rollout_id: int,
    reuse_on_policy_log_probs: bool = True,
    values: dict[int, torch.Tensor] | None = None,
) -> dict[str, float]:
    """Train the policy on one rollout (see the module docstring); returns `train/*` and `perf/*` metrics.

    Metrics are means over the optimizer steps of this rollout, except `train/lr` (the lr of the last
    step). `rollout_id` only labels errors and logs. `reuse_on_policy_log_probs=False` forces the
    separate old-log-prob forward (tests compare the two). `values`: what `train_critic` returned for
    this rollout on the critic rank of the same data-parallel index (ppo).
    """
    t0 = time.perf_counter()
    cfg = backend.cfg
    plans, batches = plan_and_pack(backend, train_data)
    if not is_sft(cfg):
        fill_policy_inputs(
            backend,
            train_data,
            [i for p in plans for i in p.local_indices],
            [b for mbs in batches for b in mbs],
            num_steps=len(plans),
            reuse_on_policy_log_probs=reuse_on_policy_log_probs,
            values=values,
        )
    sft = is_sft(cfg)
    algo = cfg.algo

    def loss(batch, log_probs, entropy, normalizer):
        return packed_loss(algo, log_probs, None if sft else entropy, batch, normalizer)

    role = Role("train", loss, cfg.optimizer, with_entropy=not sft, entropy_grad=algo.entropy_coef != 0)
    metrics = reduce_over_steps([optimizer_step(backend, train_data, p, mbs, role) for p, mbs in zip(plans, batches)], lr_key="train/lr")
    metrics.update(perf_metrics(t0, sum(len(train_data["tokens"][i]) for p in plans for i in p.global_indices)))
    metrics.update(backend.parameter_metrics())  # what trains (LoRA: the adapters) and its optimizer memory
    return metrics


def train_critic(
    backend: TrainerBackend, train_data: TrainData, *, rollout_id: int
) -> tuple[dict[str, float], dict[int, torch.Tensor]]:
    """Train PPO's critic on one rollout: the same steps as `train_rollout`, with the value loss.

    Returns `critic/*` metrics (`value_loss`, `value_clipfrac`, `explained_variance`, `value_mean`,
    `grad_norm`, `lr`) and `perf/critic_train_time`, and this rank's pre-update values by sample index,
    for the actor rank with the same data-parallel index.
    """
    t0 = time.perf_counter()
    cfg = backend.cfg
    plans, batches = plan_and_pack(backend, train_data)
    values, stats = fill_value_inputs(
        backend, train_data, [i for p in plans for i in p.local_indices], [b for mbs in batches for b in mbs]
    )
    critic = cfg.critic
    schedule = dataclasses.replace(cfg.optimizer, lr=critic.critic_lr, lr_warmup_iters=critic.critic_lr_warmup_iters)
    algo = cfg.algo

    def loss(batch, values, entropy, normalizer):
        return packed_value_loss(algo, values, batch, normalizer)

    role = Role("critic", loss, schedule, with_entropy=False, entropy_grad=False)
    metrics = reduce_over_steps([optimizer_step(backend, train_data, p, mbs, role) for p, mbs in zip(plans, batches)], lr_key="critic/lr")
    metrics.update(stats)
    metrics["perf/critic_train_time"] = time.perf_counter() - t0
    return metrics, values


def plan_and_pack(backend: TrainerBackend, train_data: TrainData) -> tuple[list[StepPlan], list[list[PackedBatch]]]:
    """This rank's optimizer steps of the rollout and their micro-batches, each packed once."""
    cfg = backend.cfg
    d = cfg.data
    plans = plan_steps(
        len(train_data["tokens"]),
        global_batch_size=d.global_batch_size,
        num_steps=d.num_steps_per_rollout or 1,
        micro_batch_size=cfg.train.micro_batch_size,
        dp_rank=backend.dp_rank,
        dp_world_size=backend.dp_size,
        lengths=[len(t) for t in train_data["tokens"]],
        max_tokens_per_gpu=cfg.train.max_tokens_per_gpu if cfg.train.use_dynamic_batch_size else None,
    )
    return plans, [[pack_samples(train_data, mb, backend.device) for mb in p.micro_batches] for p in plans]


def is_sft(cfg) -> bool:
    return cfg.algo.loss_type == "sft_loss"


@dataclasses.dataclass(frozen=True)
class Role:
    """What differs between the policy's step and the critic's: the metric prefix, the loss
    (`loss(batch, output, entropy, normalizer) -> (loss, metrics)`; output = log-probs or values),
    the lr schedule and whether the entropy is computed (and differentiated)."""

    prefix: str
    loss: Callable[..., tuple[torch.Tensor, dict[str, Any]]]
    schedule: Any
    with_entropy: bool
    entropy_grad: bool


def optimizer_step(
    backend: TrainerBackend, train_data: TrainData, plan: StepPlan, mbs: list[PackedBatch], role: Role
) -> dict[str, float]:
    """Forward-backward of this rank's micro-batches of one step, then one optimizer step; the step's metrics."""
    normalizer = loss_normalizer(backend.cfg.algo, train_data, plan.global_indices)
    sums: dict[str, float] = {}

    def loss_fn(batch: PackedBatch, output: torch.Tensor, entropy: torch.Tensor | None) -> torch.Tensor:
        loss, metrics = role.loss(batch, output, entropy, normalizer)
        for key, value in {"loss": loss, **metrics}.items():
            combine_metric(sums, key, float(value.detach() if isinstance(value, torch.Tensor) else value))
        return loss

    backend.forward_backward(mbs, loss_fn, with_entropy=role.with_entropy, entropy_grad=role.entropy_grad)
    lr = lr_at(backend.num_optimizer_steps, role.schedule)
    grad_norm, stepped = backend.optimizer_step(lr)
    p = role.prefix
    out = {f"{p}/{k}": v for k, v in backend.all_reduce_metrics(sums).items()}
    out.update({f"{p}/grad_norm": grad_norm, f"{p}/lr": lr, f"{p}/skipped_step": 0.0 if stepped else 1.0})
    return out
