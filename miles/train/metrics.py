"""How the RL step's metrics are folded: over micro-batches, over data-parallel ranks, over steps.

Within a step the losses are normalised by the whole global batch, so a metric's sum over
micro-batches (and then over data-parallel ranks, `TrainerBackend.all_reduce_metrics`) is the step's
mean; `*_max`/`*_min` fold by max/min. Over the optimizer steps of one rollout the result is the mean
per step, except `train/lr` (the last step's).
"""

from __future__ import annotations

import time


def combine_metric(acc: dict[str, float], key: str, value: float) -> None:
    """Fold one micro-batch's metric into the step's: `*_max`/`*_min` by max/min, the rest by sum."""
    if key not in acc:
        acc[key] = value
    elif key.endswith("_max"):
        acc[key] = max(acc[key], value)
    elif key.endswith("_min"):
        acc[key] = min(acc[key], value)
    else:
        acc[key] += value


def reduce_over_steps(step_metrics: list[dict[str, float]], *, lr_key: str = "train/lr") -> dict[str, float]:
    """One rollout's metrics from its optimizer steps' (same keys in every step); `lr_key`: the last step's."""
    metrics: dict[str, float] = {}
    for key in step_metrics[0]:
        values = [m[key] for m in step_metrics]
        if key == lr_key:
            metrics[key] = values[-1]
        elif key.endswith("_max"):
            metrics[key] = max(values)
        elif key.endswith("_min"):
            metrics[key] = min(values)
        else:
            metrics[key] = sum(values) / len(values)
    return metrics


def perf_metrics(t0: float, tokens: int) -> dict[str, float]:
    """`perf/train_step_time` since `t0` (time.perf_counter) and the whole DP group's tokens per second."""
    elapsed = time.perf_counter() - t0
    return {
        "perf/train_step_time": elapsed,
        "perf/train_tokens_per_s": tokens / elapsed if elapsed > 0 else 0.0,
    }
