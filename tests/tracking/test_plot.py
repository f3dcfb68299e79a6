"""plot_curves: a valid PNG written atomically; the curves it draws are the logged values."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from miles.tracking.plot import curves, plot_curves

RECORDS = [
    {"step": 0, "time": 1.0, "eval/arith/accuracy": 0.1, "eval/math/accuracy": 0.0},
    {"step": 1, "time": 2.0, "rollout/raw_reward": 0.2, "rollout/reward_std": 0.1},
    {"step": 2, "time": 3.0, "rollout/raw_reward": float("nan")},
    {"step": 2, "time": 4.0, "rollout/raw_reward": 0.4, "eval/arith/accuracy": 0.5},  # a resume redid step 2
]


def _write(path: Path) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    return path


def test_curves_match_patterns_and_later_records_win() -> None:
    assert curves(RECORDS, "rollout/raw_reward") == {"rollout/raw_reward": ([1, 2], [0.2, 0.4])}
    assert curves(RECORDS, "eval/*/accuracy") == {
        "eval/arith/accuracy": ([0, 2], [0.1, 0.5]),
        "eval/math/accuracy": ([0], [0.0]),
    }
    assert curves(RECORDS, "train/*") == {}


def test_png_is_valid_and_written_atomically(tmp_path: Path) -> None:
    out = plot_curves(_write(tmp_path / "metrics.jsonl"), tmp_path / "plots" / "curves.png")
    assert out == tmp_path / "plots" / "curves.png"
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    assert (width, height) == (700, 560)  # 7 x (2.8 per panel x 2 panels) inches at 100 dpi
    assert data[-8:-4] == b"IEND"
    assert sorted(p.name for p in out.parent.iterdir()) == ["curves.png"]  # no temp file left


def test_missing_metrics_file_raises(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        plot_curves(tmp_path / "nope.jsonl", tmp_path / "x.png")
    assert not (tmp_path / "x.png").exists()
