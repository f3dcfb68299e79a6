"""Every recipe's `--help` is a screenful plus; SGLang's pass-through options wait behind `--help-group sglang`.

Issue 28 (item 5): `miles train --model-name qwen3-4b --help` printed SGLang's ~600 options inline
(2,800 lines at 100 columns) where the tiny recipe's help was 150. The short help shows the same
panels for every recipe (miles_cli/help.py BRIEF_PANELS) and names the others in one line, with
their option counts and how to show one (a family of panels, such as the three SGLang ones, is one
name). Through the real program, at 100 columns.

Run: pytest tests/cli/test_help_length.py
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from recipes import RECIPES

ROOT = Path(__file__).resolve().parents[2]


def _miles(*args: str, columns: int = 100) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": str(columns), "NO_COLOR": "1"}
    r = subprocess.run([sys.executable, "-m", "miles_cli.main", *args], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout


def _panels(text: str) -> list[str]:
    return [line[:-1] for line in text.splitlines() if re.fullmatch(r"[A-Z][A-Za-z -]*:", line)]


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_every_recipes_help_fits_in_300_lines_and_says_how_to_see_sglang(recipe):
    text = _miles("train", "--model-name", recipe, "--help")
    assert len(text.splitlines()) <= 300, f"{recipe}: {len(text.splitlines())} lines"
    assert _panels(text) == ["Recipe", "Data", "Optimizer", "Checkpoint", "Run", "Help", "More options"]
    assert "--sglang-server-" not in text.split("More options:")[0].replace("--help-group", "")
    more = " ".join(text.split("More options:")[1].split())
    assert re.search(r"\bsglang \(\d{3}\)", more), more  # the three SGLang panels counted as one group
    assert "`miles train --help-group GROUP` (e.g. `--help-group sglang`)" in more, more


def test_help_group_sglang_lists_every_sglang_panel_in_full():
    text = _miles("train", "--model-name", "qwen3-4b", "--help-group", "sglang")
    assert _panels(text)[:3] == ["SGLang launch", "SGLang server", "SGLang router"]
    flags = re.findall(r"^  (--sglang-[a-z0-9-]+)", text, flags=re.M)
    assert len(flags) > 400 and "--sglang-mem-fraction-static" in flags and "--sglang-router-command" in flags
    one = _miles("train", "--model-name", "qwen3-4b", "--help-group", "sglang-router")
    assert _panels(one)[0] == "SGLang router" and "SGLang server" not in _panels(one)


def test_tiny_recipe_help_keeps_its_options():
    text = _miles("train", "--help")
    for flag in ("--model-name", "--mode", "--num-rollout", "--lr", "--save", "--dry-run", "--help-all"):
        assert re.search(rf"^  {flag}\b", text, flags=re.M), flag
    assert len(text.splitlines()) <= 300
