"""Whether a run is already complete, read from its files before anything starts.

A rerun of a finished run (the same command again, or with a changed `--lr`) trains nothing, so it
must change nothing: not `options.json` (which says what trained), not the MLflow params, not the
metrics. `completed_run(cfg, run_dir)` says so from the checkpoint tracker and `metrics.jsonl`
alone, and returns what the finished run's summary shows; the CLI then starts neither Ray nor a sink.

A run is complete when `--load`'s latest complete checkpoint is that of the last rollout
(`--num-rollout`) and, when an eval is due after that step, its eval is in `metrics.jsonl` (a run
killed between its last checkpoint and that eval is not complete: the driver runs the missing eval).
With `--num-epoch` (the dataset decides the step count) it is never called complete here.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from miles.ckpt.checkpoint_dir import latest_checkpoint

METRICS_FILE = "metrics.jsonl"  # miles.tracking.jsonl.METRICS_FILE (that module is not imported here)
PLOT_FILE = "curves.png"


@dataclasses.dataclass
class CompletedRun:
    last_rollout: int
    final_step: int
    first_eval: dict[str, float]
    last_eval: dict[str, float]
    plot: Path | None


def _rows(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / METRICS_FILE
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip():
            try:
                rows.append(json.loads(line))
            except ValueError:
                continue  # a torn last line: the tracker drops it when it opens the file
    return rows


def _eval_of(rows: list[dict[str, Any]], step: int | None = None) -> dict[str, float]:
    out: dict[str, float] = {}
    for row in rows:
        if step is None or row.get("step") == step:
            evals = {k: v for k, v in row.items() if k.startswith("eval/")}
            if evals:
                out = {**(out if step is not None else {}), **evals}
    return out


def completed_run(cfg: Any, run_dir: str | Path) -> CompletedRun | None:
    """The finished run's summary when this command would train nothing (see module doc), else None."""
    load, num_rollout = cfg.ckpt.load, cfg.data.num_rollout
    if not load or num_rollout is None:
        return None
    found = latest_checkpoint(load, flag="--load")
    if found is None or found.rollout_id + 1 < num_rollout:
        return None
    run_dir = Path(run_dir)
    rows = _rows(run_dir)
    final_step = found.rollout_id + 1
    if cfg.eval.eval_interval is not None and not _eval_of(rows, final_step):
        return None  # the eval after the last step is missing: the driver runs it
    plot = run_dir / PLOT_FILE
    return CompletedRun(found.rollout_id, final_step, _eval_of(rows, 0), _eval_of(rows), plot if plot.is_file() else None)
