"""`.ci/run` runs the README's two commands as written, in order, so CI sees what a new user sees.

Run: pytest tests/docs/test_ci_runs_readme.py
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _readme_commands() -> list[str]:
    section = ROOT.joinpath("README.md").read_text().split("## Two commands", 1)[1].split("\n## ", 1)[0]
    return [block.strip() for block in re.findall(r"```bash\n(.*?)```", section, re.S)]


def test_ci_runs_both_readme_commands_in_order():
    commands = _readme_commands()
    assert len(commands) == 2 and "miles full-train" in commands[0] and "pytest" in commands[1]
    lines = [ln.strip() for ln in ROOT.joinpath(".ci/run").read_text().splitlines()]
    where = [lines.index(c) if c in lines else -1 for c in commands]
    assert -1 not in where, f".ci/run must run each README command verbatim: {commands}"
    assert where == sorted(where)
