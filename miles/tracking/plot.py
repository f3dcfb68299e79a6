"""Training curves as a PNG from a run's `metrics.jsonl`: reward and eval accuracy per step.

    python -m miles.tracking.plot runs/<run>/metrics.jsonl runs/<run>/curves.png

One panel per entry of `keys`; an entry may be an fnmatch pattern, so the default
`("rollout/raw_reward", "eval/*/accuracy")` draws the reward and every eval dataset's accuracy (the
mean eval reward instead when no eval reports an accuracy, e.g. f1). A panel whose pattern matches
nothing says "no data". Uses matplotlib's Agg canvas directly (no
pyplot, no display, no global backend switch) and writes atomically: a temp file in the same
directory, then rename, so a reader never sees half a PNG.
"""

from __future__ import annotations

import fnmatch
import math
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from miles.tracking.jsonl import read_metrics

DEFAULT_KEYS = ("rollout/raw_reward", "eval/*/accuracy")


def curves(records: list[dict], pattern: str) -> dict[str, tuple[list[int], list[float]]]:
    """{key: (steps, values)} for every key matching `pattern`, in step order, non-finite values skipped.

    When a step was logged twice (a resumed run redid it), the later record wins.
    """
    by_key: dict[str, dict[int, float]] = {}
    for rec in records:
        for key, value in rec.items():
            if key in ("step", "time") or not fnmatch.fnmatchcase(key, pattern):
                continue
            if isinstance(value, (int, float)) and math.isfinite(value):
                by_key.setdefault(key, {})[int(rec["step"])] = float(value)
    return {k: (sorted(v), [v[s] for s in sorted(v)]) for k, v in sorted(by_key.items())}


def plot_curves(metrics_jsonl: Path, out_png: Path, *, keys: Sequence[str] = DEFAULT_KEYS) -> Path:
    """Draw one panel per key pattern from `metrics_jsonl` into `out_png`; returns `out_png`."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    records = read_metrics(metrics_jsonl)
    out_png = Path(out_png)
    fig = Figure(figsize=(7, 2.8 * len(keys)), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(keys), 1, squeeze=False)[:, 0]
    for ax, pattern in zip(axes, keys):
        found = curves(records, pattern)
        if not found and pattern.endswith("/accuracy"):
            # Evals with a fractional reward (f1, custom) report no accuracy; draw their mean reward.
            pattern = pattern[: -len("accuracy")] + "reward"
            found = curves(records, pattern)
        for key, (steps, values) in found.items():
            ax.plot(steps, values, marker="o", markersize=3, label=key)
        if found:
            ax.legend(fontsize="small")
        else:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
        ax.set_title(pattern)
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are rollout ids
        ax.grid(alpha=0.3)
    out_png.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_png.with_name(f".{out_png.name}.{os.getpid()}.tmp")
    try:
        fig.savefig(tmp, format="png", dpi=100)
        os.replace(tmp, out_png)
    finally:
        tmp.unlink(missing_ok=True)
    return out_png


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python -m miles.tracking.plot METRICS_JSONL OUT_PNG")
    print(plot_curves(Path(sys.argv[1]), Path(sys.argv[2])))
