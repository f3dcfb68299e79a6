"""Weights & Biases sink (`--use-wandb`), an optional extra: `pip install 'miles[wandb]'`.

`wandb.init(project=--wandb-project or "miles", group=--wandb-group or the run id, name=the run id,
id=<run id made wandb-safe>, resume="allow", dir=--wandb-dir or <run_dir>/wandb, mode=--wandb-mode,
config=<flattened params>)`. The wandb id is derived from the miles run id, so a resumed miles run
continues the same wandb run. `--wandb-mode offline` (the default) writes the run under the wandb
directory for a later `wandb sync <dir>/wandb/offline-run-*`; `online` needs `wandb login` or
`WANDB_API_KEY`; `disabled` turns the sink off without needing the package at all.

Limitation: wandb only accepts increasing steps, so after a resume the redone steps below the run's
last logged step are dropped by wandb (it warns); the JSONL file, MLflow and TensorBoard have them.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from miles.config.tracking import TrackingConfig
from miles.errors import UserError
from miles.tracking.keys import flatten_params, wandb_run_id

MISSING_MESSAGE = "--use-wandb needs the wandb package; install it with pip install 'miles[wandb]'."


def import_wandb() -> Any:
    try:
        return importlib.import_module("wandb")
    except ImportError:
        raise UserError(MISSING_MESSAGE, option="--use-wandb") from None


class WandbSink:
    name = "wandb"

    def __init__(self, cfg: TrackingConfig, *, run_dir: Path, run_id: str, params: Mapping[str, Any] | Any):
        wandb = import_wandb()
        self.dir = Path(cfg.wandb_dir) if cfg.wandb_dir else Path(run_dir) / "wandb"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(
            project=cfg.wandb_project or "miles",
            group=cfg.wandb_group or run_id,
            name=run_id,
            id=wandb_run_id(run_id),
            resume="allow",
            dir=str(self.dir),
            mode=cfg.wandb_mode,
            config=flatten_params(params),
        )

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        self.run.log(dict(metrics), step=step)

    def close(self, status: str) -> None:
        self.run.finish(exit_code=0 if status == "FINISHED" else 1)
