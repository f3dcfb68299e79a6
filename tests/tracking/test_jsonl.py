"""metrics.jsonl: one record per step (every log call of the step merged into it), appended across restarts, truncated at the resume step."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from miles.config.tracking import TrackingConfig
from miles.tracking import Tracker
from miles.tracking.jsonl import read_metrics


def _tracker(run_dir: Path, **kw) -> Tracker:
    return Tracker(TrackingConfig(), run_dir=run_dir, run_id="r", params={}, **kw)


def test_one_record_per_step_holding_every_log_call_of_it_with_exact_floats(run_dir: Path) -> None:
    t = _tracker(run_dir)
    x = 0.1 + 0.2  # 0.30000000000000004: must round-trip bit-exactly
    t.log({"rollout/raw_reward": x, "train/loss": float("nan")}, step=0)
    t.log({"eval/arith/accuracy": 1}, step=0)  # the same step: merged into its line
    t.log({"rollout/raw_reward": -1e-300}, step=7)
    t.log({"perf/step_time": 2.5}, step=7)
    assert t.finish() == {}
    recs = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in recs] == [0, 7]
    assert recs[0]["rollout/raw_reward"] == x and math.isnan(recs[0]["train/loss"]) and recs[0]["eval/arith/accuracy"] == 1.0
    assert recs[1] == {"step": 7, "time": recs[1]["time"], "rollout/raw_reward": -1e-300, "perf/step_time": 2.5}
    assert recs[0]["time"] <= recs[1]["time"]


def test_pandas_reads_one_full_row_per_step(run_dir: Path) -> None:
    pd = pytest.importorskip("pandas")
    t = _tracker(run_dir)
    for step in range(3):
        t.log({"rollout/raw_reward": step / 10, "train/loss": 1.0}, step=step)
        t.log({"perf/step_time": 1.0 + step}, step=step)
    t.finish()
    frame = pd.read_json(run_dir / "metrics.jsonl", lines=True)
    assert list(frame["step"]) == [0, 1, 2] and not frame.isna().any().any()


def test_a_step_begun_by_an_earlier_process_is_not_merged_into(run_dir: Path) -> None:
    t = _tracker(run_dir)
    t.log({"rollout/raw_reward": 0.5}, step=3)
    t.finish("KILLED")
    t = _tracker(run_dir)
    t.log({"perf/step_time": 1.0}, step=3)
    t.finish()
    assert [sorted(r) for r in read_metrics(run_dir / "metrics.jsonl")] == [
        ["rollout/raw_reward", "step", "time"], ["perf/step_time", "step", "time"]]


def test_restart_appends_and_resume_drops_redone_steps(run_dir: Path) -> None:
    t = _tracker(run_dir)
    for step in range(5):
        t.log({"rollout/raw_reward": step / 10}, step=step)
    t.finish("KILLED")
    t = _tracker(run_dir)  # no resume step: plain append
    t.log({"rollout/raw_reward": 0.5}, step=5)
    t.finish()
    assert [r["step"] for r in read_metrics(run_dir / "metrics.jsonl")] == [0, 1, 2, 3, 4, 5]

    t = _tracker(run_dir, resume_step=3)  # steps 3.. are redone
    assert [r["step"] for r in read_metrics(run_dir / "metrics.jsonl")] == [0, 1, 2]
    t.log({"rollout/raw_reward": 0.9}, step=3)
    t.finish()
    recs = read_metrics(run_dir / "metrics.jsonl")
    assert [(r["step"], r["rollout/raw_reward"]) for r in recs] == [(0, 0.0), (1, 0.1), (2, 0.2), (3, 0.9)]
    assert not list(run_dir.glob("*.tmp"))


def test_torn_last_line_is_dropped_on_open(run_dir: Path) -> None:
    run_dir.mkdir()
    path = run_dir / "metrics.jsonl"
    path.write_text('{"step": 0, "time": 1.0, "a": 1.0}\n{"step": 1, "ti')  # killed mid-write
    t = _tracker(run_dir)
    t.log({"a": 2.0}, step=1)
    t.finish()
    lines = path.read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [0, 1]


def test_resume_step_zero_empties_the_file(run_dir: Path) -> None:
    t = _tracker(run_dir)
    t.log({"a": 1.0}, step=0)
    t.finish()
    _tracker(run_dir, resume_step=0).finish()
    assert (run_dir / "metrics.jsonl").read_text() == ""


@pytest.mark.parametrize(
    "metrics,step,error",
    [
        ({"step": 1.0}, 0, ValueError),  # would overwrite the record's own field
        ({"time": 1.0}, 0, ValueError),
        ({"a": "high"}, 0, TypeError),
        ({"a": None}, 0, TypeError),
        ({1: 1.0}, 0, TypeError),
        ({"a": 1.0}, -1, TypeError),
        ({"a": 1.0}, 1.5, TypeError),
        ({"a": 1.0}, True, TypeError),
    ],
)
def test_bad_metrics_or_step_raise_before_anything_is_written(run_dir: Path, metrics, step, error) -> None:
    t = _tracker(run_dir)
    with pytest.raises(error):
        t.log(metrics, step=step)
    t.finish()
    assert (run_dir / "metrics.jsonl").read_text() == ""


def test_tensor_values_are_accepted(run_dir: Path) -> None:
    import torch

    t = _tracker(run_dir)
    t.log({"train/loss": torch.tensor(0.25), "rollout/n": torch.tensor(3)}, step=2)
    t.finish()
    rec = read_metrics(run_dir / "metrics.jsonl")[0]
    assert rec["train/loss"] == 0.25 and rec["rollout/n"] == 3.0


def test_a_corrupt_record_is_reported_with_file_and_line(run_dir: Path) -> None:
    run_dir.mkdir()
    path = run_dir / "metrics.jsonl"
    path.write_text('{"step": 0, "time": 1.0}\nnot json\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl:2: not a metrics record"):
        _tracker(run_dir, resume_step=1)
    with pytest.raises(ValueError, match=r"metrics.jsonl:2: not a metrics record"):
        read_metrics(path)
