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

Use: `metrics = train_rollout(backend, train_data, rollout_id=0)`.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from miles.backends.base import PackedBatch, TrainerBackend
from miles.train.batching import StepPlan, plan_steps
from miles.train.inputs import fill_policy_inputs
from miles.train.loss import loss_normalizer, packed_loss
from miles.train.lr_schedule import lr_at
from miles.train.metrics import combine_metric, perf_metrics, reduce_over_steps
from miles.train.packing import pack_samples

TrainData = dict[str, Any]


def train_rollout(
    backend: TrainerBackend, train_data: TrainData, *, rollout_id: int, reuse_on_policy_log_probs: bool = True
) -> dict[str, float]:
    """Train on one rollout (see the module docstring); returns `train/*` and `perf/*` metrics.

    Metrics are means over the optimizer steps of this rollout, except `train/lr` (the lr of the last
    step). `rollout_id` only labels errors and logs. `reuse_on_policy_log_probs=False` forces the
    separate old-log-prob forward (tests compare the two).
    """
    t0 = time.perf_counter()
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
    batches = [[pack_samples(train_data, mb, backend.device) for mb in p.micro_batches] for p in plans]
    if not is_sft(cfg):
        fill_policy_inputs(
            backend,
            train_data,
            [i for p in plans for i in p.local_indices],
            [b for mbs in batches for b in mbs],
            num_steps=len(plans),
            reuse_on_policy_log_probs=reuse_on_policy_log_probs,
        )
    metrics = reduce_over_steps([optimizer_step(backend, train_data, p, mbs) for p, mbs in zip(plans, batches)])
    metrics.update(perf_metrics(t0, sum(len(train_data["tokens"][i]) for p in plans for i in p.global_indices)))
    return metrics


def is_sft(cfg) -> bool:
    return cfg.algo.loss_type == "sft_loss"


def optimizer_step(backend: TrainerBackend, train_data: TrainData, plan: StepPlan, mbs: list[PackedBatch]) -> dict[str, float]:
    """Forward-backward of this rank's micro-batches of one step, then one optimizer step; the step's metrics."""
    cfg = backend.cfg
    algo = cfg.algo
    sft = is_sft(cfg)
    normalizer = loss_normalizer(algo, train_data, plan.global_indices)
    sums: dict[str, float] = {}

    def loss_fn(batch: PackedBatch, log_probs: torch.Tensor, entropy: torch.Tensor | None) -> torch.Tensor:
        loss, metrics = packed_loss(algo, log_probs, None if sft else entropy, batch, normalizer)
        for key, value in {"loss": loss, **metrics}.items():
            combine_metric(sums, key, float(value.detach() if isinstance(value, torch.Tensor) else value))
        return loss

    backend.forward_backward(mbs, loss_fn, with_entropy=not sft, entropy_grad=algo.entropy_coef != 0)
    lr = lr_at(backend.num_optimizer_steps, cfg.optimizer)
    grad_norm, stepped = backend.optimizer_step(lr)
    out = {f"train/{k}": v for k, v in backend.all_reduce_metrics(sums).items()}
    out.update({"train/grad_norm": grad_norm, "train/lr": lr, "train/skipped_step": 0.0 if stepped else 1.0})
    return out
