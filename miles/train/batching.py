"""How one rollout's samples are cut into optimizer steps, data-parallel shards and micro-batches.

A rollout of N samples runs `num_steps` optimizer steps of `global_batch_size` samples each, in order
(step s trains on samples [s*G, (s+1)*G)). Within a step, DP rank r takes the r-th contiguous slice of
G / dp_world_size samples and splits it into micro-batches of `micro_batch_size` (the last one may be
smaller). Every rank runs the same number of steps, so their gradient all-reduces line up.

This is pure index arithmetic (no torch); the RL step (miles/train/step.py) uses the same plan for
the forward-only passes (old/ref log-probs) and for the training pass, so both see identical
micro-batches. Micro-batches are cut by sample count (`--micro-batch-size`) in `cut_micro_batches`,
the one place a token budget (upstream's `--use-dynamic-batch-size` / `--max-tokens-per-gpu`) will
cut them instead.
"""

from __future__ import annotations

from dataclasses import dataclass

from miles.errors import UserError


@dataclass(frozen=True)
class StepPlan:
    """The sample indices (into the rollout) of one optimizer step on this rank, by micro-batch."""

    global_indices: list[int]
    """All samples of this step across DP ranks (for the loss normaliser)."""
    micro_batches: list[list[int]]
    """This rank's share of the step, in micro-batches."""

    @property
    def local_indices(self) -> list[int]:
        return [i for mb in self.micro_batches for i in mb]


def plan_steps(
    num_samples: int,
    *,
    global_batch_size: int | None,
    num_steps: int,
    micro_batch_size: int,
    dp_rank: int = 0,
    dp_world_size: int = 1,
) -> list[StepPlan]:
    """Cut `num_samples` into `num_steps` steps; `global_batch_size=None` means num_samples / num_steps."""
    if num_steps < 1:
        raise UserError(f"--num-steps-per-rollout is {num_steps}; it must be at least 1.", option="--num-steps-per-rollout")
    if global_batch_size is None:
        global_batch_size = num_samples // num_steps
    if global_batch_size < 1 or global_batch_size * num_steps != num_samples:
        raise UserError(
            f"the rollout has {num_samples} samples but --global-batch-size {global_batch_size} x "
            f"--num-steps-per-rollout {num_steps} = {global_batch_size * num_steps}; make them equal.",
            option="--global-batch-size",
        )
    if global_batch_size % dp_world_size:
        raise UserError(
            f"--global-batch-size {global_batch_size} does not split evenly over {dp_world_size} data-parallel "
            "training workers; make it a multiple of the worker count.",
            option="--global-batch-size",
        )
    if micro_batch_size < 1:
        raise UserError(f"--micro-batch-size is {micro_batch_size}; it must be at least 1.", option="--micro-batch-size")
    per_rank = global_batch_size // dp_world_size
    plans = []
    for s in range(num_steps):
        start = s * global_batch_size
        mine = list(range(start + dp_rank * per_rank, start + (dp_rank + 1) * per_rank))
        plans.append(
            StepPlan(
                global_indices=list(range(start, start + global_batch_size)),
                micro_batches=cut_micro_batches(mine, micro_batch_size=micro_batch_size),
            )
        )
    return plans


def cut_micro_batches(indices: list[int], *, micro_batch_size: int) -> list[list[int]]:
    """This rank's samples of one step, in order, as micro-batches of `micro_batch_size` (the last may
    be smaller). A token budget goes here: it needs the samples' lengths and must keep the order, since
    the loss normaliser is the whole step's and the gradient sum does not depend on the cut."""
    return [indices[i : i + micro_batch_size] for i in range(0, len(indices), micro_batch_size)]
