"""The layer rules of DESIGN.md, as import-linter contracts (.importlinter), checked on every run:
config imports no rollout/backends/ray; backends no ray/rollout; rollout no ray/backends; algo no other
miles package; no import circle between miles' packages. A broken rule fails here naming the import chain."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def lint_imports() -> list[str]:
    exe = shutil.which("lint-imports") or str(Path(sys.executable).with_name("lint-imports"))
    return [exe, str(ROOT / ".importlinter"), "--no-cache"]


def test_import_contracts_are_kept():
    # This checkout's `miles` first: the venv may hold an editable install of another one.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run(lint_imports(), cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-2000:]
    assert "Contracts: 6 kept, 0 broken." in r.stdout, r.stdout[-3000:]


def test_contracts_name_every_layer_rule():
    text = (ROOT / ".importlinter").read_text()
    for contract in ("[importlinter:contract:config]", "[importlinter:contract:backends]", "[importlinter:contract:rollout]",
                     "[importlinter:contract:algo]", "[importlinter:contract:train]", "[importlinter:contract:acyclic]"):
        assert contract in text, contract
    assert "include_external_packages = True" in text  # so `ray` itself can be forbidden


def test_the_architecture_page_has_a_row_for_every_package():
    """docs/architecture.md's layer table names every package of miles/ (a new package without a row,
    and so without a stated import rule, fails here)."""
    table = (ROOT / "docs" / "architecture.md").read_text()
    packages = sorted(p.name for p in (ROOT / "miles").iterdir() if (p / "__init__.py").is_file())
    missing = [p for p in packages if f"`miles.{p}`" not in table]
    assert not missing, f"docs/architecture.md has no row for: {missing}"
