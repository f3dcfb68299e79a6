"""TensorBoard sink: the event file holds exactly the logged scalars; resume purges redone steps."""

from __future__ import annotations

from pathlib import Path

from miles.config.tracking import TrackingConfig
from miles.tracking import Tracker


def _scalars(log_dir: Path, tag: str) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def test_event_file_holds_the_logged_scalars(run_dir: Path) -> None:
    t = Tracker(TrackingConfig(use_tensorboard=True), run_dir=run_dir, run_id="r", params={})
    t.log({"rollout/raw_reward": 0.5, "train/loss": 2.0}, step=1)
    t.log({"rollout/raw_reward": 0.75}, step=2)
    assert t.finish() == {}
    log_dir = run_dir / "tensorboard"  # the default when --tensorboard-dir is unset
    assert len(list(log_dir.glob("events.out.tfevents.*"))) == 1
    assert _scalars(log_dir, "rollout/raw_reward") == [(1, 0.5), (2, 0.75)]  # 0.5/0.75 exact in float32
    assert _scalars(log_dir, "train/loss") == [(1, 2.0)]


def test_tensorboard_dir_flag_and_resume_purges_redone_steps(tmp_path: Path) -> None:
    log_dir = tmp_path / "tb"
    cfg = TrackingConfig(use_tensorboard=True, tensorboard_dir=str(log_dir))
    t = Tracker(cfg, run_dir=tmp_path / "run", run_id="r", params={})
    for step in range(4):
        t.log({"rollout/raw_reward": float(step)}, step=step)
    t.finish("FAILED")
    t = Tracker(cfg, run_dir=tmp_path / "run", run_id="r", params={}, resume_step=2)
    t.log({"rollout/raw_reward": 20.0}, step=2)
    t.finish()
    assert not (tmp_path / "run" / "tensorboard").exists()
    assert _scalars(log_dir, "rollout/raw_reward") == [(0, 0.0), (1, 1.0), (2, 20.0)]
