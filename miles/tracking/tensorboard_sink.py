"""TensorBoard sink (`--use-tensorboard`): scalars via torch's `SummaryWriter`, one tag per metric key.

Event files go to `--tensorboard-dir` (or `$TENSORBOARD_DIR`), else `<run_dir>/tensorboard`; view them
with `tensorboard --logdir <that dir>`. Keys are kept verbatim (`/` groups the charts). On resume the
writer is opened with `purge_step=resume_step`, which tells TensorBoard to discard the events of the
old attempt at steps >= resume_step, so redone steps are not drawn twice. Flushed on every `log`.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from miles.config.tracking import TrackingConfig


class TensorBoardSink:
    name = "tensorboard"

    def __init__(self, cfg: TrackingConfig, *, run_dir: Path, resume_step: int | None = None):
        from torch.utils.tensorboard import SummaryWriter  # heavy: only when the sink is enabled

        self.log_dir = Path(cfg.tensorboard_dir) if cfg.tensorboard_dir else Path(run_dir) / "tensorboard"
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.writer = SummaryWriter(log_dir=str(self.log_dir), purge_step=resume_step)

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, global_step=step)
        self.writer.flush()

    def close(self, status: str) -> None:
        self.writer.close()
