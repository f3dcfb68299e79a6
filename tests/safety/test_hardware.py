"""`--hardware <GPU>` where no GPU is visible exits 2 before anything starts, for every recipe, and the
dry run says what the run will really use (issue 28, item 2). Through the program, as a user runs it.

Run: pytest tests/safety/test_hardware.py
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from miles.hardware import visible_gpus

ROOT = Path(__file__).resolve().parents[2]
# Hides every GPU this machine may have, so the tests mean the same on a GPU machine.
NO_GPU = {"CUDA_VISIBLE_DEVICES": ""}


def miles(args: list[str], cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    full = {**os.environ, "PYTHONPATH": str(ROOT), "NO_COLOR": "1", "COLUMNS": "200", **(env or {})}
    return subprocess.run([sys.executable, "-m", "miles_cli.main", *args], cwd=cwd, env=full, capture_output=True, text=True, timeout=300)


def dirs(tmp: Path) -> list[str]:
    return ["--model-dir", str(tmp / "models"), "--data-dir", str(tmp / "data"), "--output-dir", str(tmp / "runs")]


@pytest.mark.parametrize("argv", [
    ["full-train", "--hardware", "H100", "--mode", "debug_minimal"],          # the tiny recipe
    ["full-train", "--hardware", "H100", "--mode", "debug_minimal", "--dry-run"],
    ["train", "--model-name", "qwen3-0.6b", "--hardware", "H200"],            # a GPU recipe
    ["eval", "--hardware", "B200", "--checkpoint", "nowhere"],
])
def test_a_gpu_asked_for_and_not_there_exits_2_with_one_sentence_and_writes_nothing(tmp_path, argv):
    r = miles([*argv, *dirs(tmp_path)], tmp_path, NO_GPU)
    out = r.stdout + r.stderr
    assert r.returncode == 2, out[-3000:]
    errors = [ln for ln in out.splitlines() if ln.startswith("Error:")]
    assert len(errors) == 1 and "--hardware" in errors[0] and "--hardware cpu" in errors[0], out[-3000:]
    assert "Traceback" not in out
    assert sorted(p.name for p in tmp_path.iterdir()) == [], "nothing may be prepared or written"


def test_the_dry_run_says_the_cpu_when_the_run_uses_the_cpu(tmp_path):
    r = miles(["full-train", "--mode", "debug_minimal", "--dry-run", *dirs(tmp_path)], tmp_path, NO_GPU)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    placement = [ln for ln in r.stdout.splitlines() if ln.startswith("Placement")]
    assert placement and "(CPU)" in placement[0] and "GPUs" not in placement[0], placement


def test_auto_falls_back_to_the_cpu_and_says_so(tmp_path):
    r = miles(["full-train", "--mode", "debug_minimal", "--hardware", "auto", "--dry-run", *dirs(tmp_path)], tmp_path, NO_GPU)
    assert r.returncode == 0 and "Placement (CPU)" in r.stdout, r.stdout[-3000:] + r.stderr[-3000:]


@pytest.mark.parametrize("mask, devices, seen", [(None, 2, 2), ("", 2, 0), ("1", 2, 1), ("0,1,2", 2, 2), ("0,-1,1", 2, 1), ("0", 0, 0)])
def test_visible_gpus_follows_cuda_visible_devices(monkeypatch, mask, devices, seen):
    monkeypatch.setattr("miles.hardware.glob.glob", lambda _p: [f"/dev/nvidia{i}" for i in range(devices)] + ["/dev/nvidiactl"])
    if mask is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", mask)
    assert visible_gpus() == seen
