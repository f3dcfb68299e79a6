"""How one rollout's samples are cut into optimizer steps, data-parallel shards and micro-batches.

A rollout of N samples runs `num_steps` optimizer steps of `global_batch_size` samples each, in order
(step s trains on samples [s*G, (s+1)*G)). Every rank runs the same number of steps, so their
gradient all-reduces line up. Within a step each DP rank takes G / dp_world_size samples:

- by sample count (default): rank r takes the r-th contiguous slice and cuts it into micro-batches
  of `micro_batch_size` (the last one may be smaller);
- by token budget (`--use-dynamic-batch-size --max-tokens-per-gpu N`, given the samples' lengths):
  the step's samples are first dealt to the ranks so that their token counts are balanced
  (`balanced_partition`: longest first, each to the rank with the fewest tokens that still has room),
  then each rank's samples are cut into the fewest micro-batches of at most N tokens (a sample longer
  than N travels alone), balanced the same way. Every rank runs the same number of micro-batches
  (the largest any rank needs): FSDP reduce-scatters after each one, so the counts must match.

Every rank computes the whole plan from the same lengths, so no rank talks to another to agree on
it. Pure index arithmetic (no torch); the RL step (miles/train/step.py) uses the same plan for the
forward-only passes (old/ref log-probs) and for the training pass, so both see identical
micro-batches. The gradient does not depend on the cut: each micro-batch's loss is normalised by the
whole step's sample (or token) count.
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
    lengths: list[int] | None = None,
    max_tokens_per_gpu: int | None = None,
) -> list[StepPlan]:
    """Cut `num_samples` into `num_steps` steps; `global_batch_size=None` means num_samples / num_steps.
    With `max_tokens_per_gpu`, micro-batches follow a token budget over the samples' `lengths`."""
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
    if max_tokens_per_gpu is not None:
        if lengths is None or len(lengths) != num_samples:
            raise ValueError("a token budget needs the length of every sample")
        if max_tokens_per_gpu < 1:
            raise UserError(f"--max-tokens-per-gpu is {max_tokens_per_gpu}; it must be at least 1.", option="--max-tokens-per-gpu")
    per_rank = global_batch_size // dp_world_size
    plans = []
    for s in range(num_steps):
        start = s * global_batch_size
        step = list(range(start, start + global_batch_size))
        if max_tokens_per_gpu is None:
            mine = step[dp_rank * per_rank : (dp_rank + 1) * per_rank]
            micro = cut_micro_batches(mine, micro_batch_size=micro_batch_size)
        else:
            micro = cut_by_tokens(step, lengths, max_tokens=max_tokens_per_gpu, dp_world_size=dp_world_size)[dp_rank]
        plans.append(StepPlan(global_indices=step, micro_batches=micro))
    return plans


def cut_micro_batches(indices: list[int], *, micro_batch_size: int) -> list[list[int]]:
    """This rank's samples of one step, in order, as micro-batches of `micro_batch_size` (the last may
    be smaller). A token budget goes here: it needs the samples' lengths and must keep the order, since
    the loss normaliser is the whole step's and the gradient sum does not depend on the cut."""
    return [indices[i : i + micro_batch_size] for i in range(0, len(indices), micro_batch_size)]


def balanced_partition(indices: list[int], lengths: list[int], parts: int, *, equal_size: bool) -> list[list[int]]:
    """`indices` in `parts` groups with balanced total length: longest first, each to the group with
    the fewest tokens so far (ties: the lowest group), among groups with room when `equal_size`
    (then every group gets len(indices) / parts). Each group sorted; deterministic."""
    cap = len(indices) // parts if equal_size else len(indices)
    groups: list[list[int]] = [[] for _ in range(parts)]
    totals = [0] * parts
    for i in sorted(indices, key=lambda i: (-lengths[i], i)):
        g = min((g for g in range(parts) if len(groups[g]) < cap), key=lambda g: (totals[g], g))
        groups[g].append(i)
        totals[g] += lengths[i]
    return [sorted(g) for g in groups]


def _fewest_micro_batches(indices: list[int], lengths: list[int], max_tokens: int) -> int:
    """The fewest balanced micro-batches of at most `max_tokens` each (a longer sample alone)."""
    alone = sum(1 for i in indices if lengths[i] > max_tokens)
    rest = [i for i in indices if lengths[i] <= max_tokens]
    k = max(1 if rest else 0, -(-sum(lengths[i] for i in rest) // max_tokens))
    while rest and max(sum(lengths[i] for i in g) for g in balanced_partition(rest, lengths, k, equal_size=False)) > max_tokens:
        k += 1
    return alone + k


def cut_by_tokens(step: list[int], lengths: list[int], *, max_tokens: int, dp_world_size: int) -> list[list[list[int]]]:
    """Per DP rank, its micro-batches of one step under a token budget (see the module docstring)."""
    ranks = balanced_partition(step, lengths, dp_world_size, equal_size=True)
    count = max(_fewest_micro_batches(r, lengths, max_tokens) for r in ranks)
    out = []
    for mine in ranks:
        alone = [[i] for i in mine if lengths[i] > max_tokens]
        rest = [i for i in mine if lengths[i] <= max_tokens]
        own = _fewest_micro_batches(mine, lengths, max_tokens) - len(alone)
        bins = balanced_partition(rest, lengths, own, equal_size=False) if own else []
        tokens = lambda mb: sum(lengths[i] for i in mb)  # noqa: E731
        # Up to the common count by halving the fullest micro-batch that has two samples: halves stay
        # within the budget. One always exists: every rank holds as many samples as the rank that
        # needs the most micro-batches, which needs at most one per sample.
        while len(bins) + len(alone) < count:
            fullest = max((b for b in bins if len(b) > 1), key=lambda b: (tokens(b), -b[0]))
            bins.remove(fullest)
            bins += balanced_partition(fullest, lengths, 2, equal_size=False)
        out.append(sorted(alone + bins, key=lambda mb: mb[0]))
    return out
