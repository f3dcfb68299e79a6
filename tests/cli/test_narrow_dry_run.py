"""At 80 columns the dry run's option listing cuts no value mid-word (issue 28, item 5).

Run: pytest tests/cli/test_narrow_dry_run.py
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_value_is_whole_at_80_columns(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "80", "NO_COLOR": "1", "CUDA_VISIBLE_DEVICES": ""}
    r = subprocess.run([sys.executable, "-m", "miles_cli.main", "train", "--model-name", "qwen3-4b",
                        "--dry-run"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert "--hf-checkpoint runs/models/Qwen3-4B  (recipe)" in r.stdout, r.stdout[:3000]
    assert "│" not in r.stdout.split("Run directory:")[0]
