"""At 80 columns the dry run cuts no value mid-word (issue 28, item 5): the option listing is one option
a line, and the plan after it (placement, memory plan, what cannot train, the SGLang commands) is
wrapped between words with a hanging indent, commands with shell continuations, so nothing relies on
the terminal's own wrap (which cuts at column 80, inside a path or a flag).

Run: pytest tests/cli/test_narrow_dry_run.py
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ARGV = ["full-train", "--model-name", "qwen3-4b", "--dry-run", "--train-deterministic"]


def dry_run(tmp_path: Path, columns: int) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": str(columns), "NO_COLOR": "1", "CUDA_VISIBLE_DEVICES": ""}
    r = subprocess.run([sys.executable, "-m", "miles_cli.main", *ARGV], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "Dry run: nothing was started." in r.stdout, r.stdout[-3000:] + r.stderr[-3000:]
    return r.stdout


def test_every_value_is_whole_at_80_columns(tmp_path):
    out = dry_run(tmp_path, 80)
    assert "--hf-checkpoint runs/models/Qwen3-4B  (recipe)" in out, out[:3000]
    assert "│" not in out.split("Run directory:")[0]
    too_long = [line for line in out.splitlines() if len(line) > 80]
    assert too_long == [], too_long


def plan(out: str) -> str:
    return out[out.index("Prepare steps"):]


def test_the_plan_at_80_columns_has_the_words_of_the_wide_plan(tmp_path):
    """Undoing the wrap (continuations joined, runs of spaces collapsed) gives the wide plan word for
    word: no word was split, dropped or reordered; each SGLang command parses to the same argv."""
    narrow, wide = plan(dry_run(tmp_path, 80)), plan(dry_run(tmp_path, 400))
    assert " \\\n" not in wide and max(len(line) for line in wide.splitlines()) > 80
    assert narrow.replace(" \\\n", " ").split() == wide.split()
    commands = [line for line in narrow.replace(" \\\n", " ").splitlines() if "sglang.launch_server" in line]
    assert len(commands) == 4
    for line in commands:
        argv = shlex.split(line.split(": ", 1)[1])
        assert argv[1:3] == ["-m", "sglang.launch_server"] and argv[argv.index("--host") + 1] == "<node ip>"
        assert argv[argv.index("--model-path") + 1] == "runs/models/Qwen3-4B"
    # A wrapped line of a sentence is indented under its first line, so the plan reads as a list.
    memory = narrow[narrow.index("  · activations"):].splitlines()
    assert memory[1].startswith("    ") and not memory[1].startswith("     ")
