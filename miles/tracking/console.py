"""Console output of a run: a rich progress bar and one compact summary line per rollout step.

    with progress() as bar:
        task = bar.add_task("RL steps", total=num_rollout, completed=start)
        for step in ...:
            print_step_summary(step, metrics, num_steps=num_rollout)   # printed above the bar
            bar.advance(task)

Both use rich's global console by default, so summary lines printed while the bar is live appear
above it instead of tearing it. `format_step_summary` is the pure formatter (tested on its own):

    step 3/10 · reward 0.412 ± 0.120 · eval arith 0.550 · len 12.3 · gen 1.2k tok/s · train 3.4k tok/s · 3.41 s

Fields whose metric is absent are left out. This is not a sink: the Tracker records the numbers.
"""

from __future__ import annotations

from collections.abc import Mapping

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)


def progress(*, console: Console | None = None, transient: bool = False) -> Progress:
    """A rich Progress with spinner, description, bar, done/total, elapsed and ETA columns."""
    return Progress(
        SpinnerColumn(),
        TextColumn("[progress.description]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("eta"),
        TimeRemainingColumn(),
        console=console,
        transient=transient,
    )


def _rate(tokens_per_s: float) -> str:
    if tokens_per_s >= 1e6:
        return f"{tokens_per_s / 1e6:.1f}M"
    if tokens_per_s >= 1e3:
        return f"{tokens_per_s / 1e3:.1f}k"
    return f"{tokens_per_s:.0f}"


def eval_headline_keys(metrics: Mapping[str, float]) -> list[str]:
    """Per eval dataset, the key to show: `eval/<ds>/accuracy` when the reward is right/wrong (only then
    is it reported), else `eval/<ds>/reward`; sorted by key."""
    names = {k.split("/")[1] for k in metrics if k.startswith("eval/") and k.count("/") == 2 and k.endswith(("/accuracy", "/reward"))}
    return sorted(f"eval/{n}/accuracy" if f"eval/{n}/accuracy" in metrics else f"eval/{n}/reward" for n in names)


# Dropped first, in this order, when the line is wider than the console: it must stay one line
# (then eval datasets from the last; step, reward and step time always stay).
_OPTIONAL = ("train ", "gen ", "len ")


def format_step_summary(
    step: int, metrics: Mapping[str, float], *, num_steps: int | None = None, width: int | None = None
) -> str:
    """One line: step, reward (± std; else the loss), eval accuracy per dataset, response length, tokens/s, step time.

    With `width`, the throughput and length fields are left out, in that order, until the line fits.
    """
    parts = [f"step {step}/{num_steps}" if num_steps is not None else f"step {step}"]
    if "rollout/raw_reward" in metrics:
        reward = f"reward {metrics['rollout/raw_reward']:.3f}"
        if "rollout/reward_std" in metrics:
            reward += f" ± {metrics['rollout/reward_std']:.3f}"
        parts.append(reward)
    elif "train/loss" in metrics:  # supervised steps (--loss-type sft_loss) have no reward
        parts.append(f"loss {metrics['train/loss']:.3f}")
    for key in eval_headline_keys(metrics):
        segs = key.split("/")
        parts.append(f"eval {segs[1]} {metrics[key]:.3f}" if segs[2] == "accuracy" else f"eval {segs[1]} reward {metrics[key]:.3f}")
    if "rollout/response_len_mean" in metrics:
        parts.append(f"len {metrics['rollout/response_len_mean']:.1f}")
    if "perf/rollout_tokens_per_s" in metrics:
        parts.append(f"gen {_rate(metrics['perf/rollout_tokens_per_s'])} tok/s")
    if "perf/train_tokens_per_s" in metrics:
        parts.append(f"train {_rate(metrics['perf/train_tokens_per_s'])} tok/s")
    if "perf/step_time" in metrics:
        parts.append(f"{metrics['perf/step_time']:.2f} s")
    for prefix in (*_OPTIONAL, "eval "):
        if width is None or len(" · ".join(parts)) <= width:
            break
        if prefix == "eval ":  # last resort: the last eval datasets (all are in metrics.jsonl)
            while len(" · ".join(parts)) > width and any(p.startswith("eval ") for p in parts):
                parts.remove([p for p in parts if p.startswith("eval ")][-1])
        else:
            parts = [p for p in parts if not p.startswith(prefix)]
    return " · ".join(parts)


def print_step_summary(
    step: int, metrics: Mapping[str, float], *, num_steps: int | None = None, console: Console | None = None
) -> None:
    """Print `format_step_summary(...)` on `console` (default: rich's global console)."""
    from rich import get_console

    console = console or get_console()
    line = format_step_summary(step, metrics, num_steps=num_steps, width=console.width)
    console.print(line, markup=False, highlight=False)
