"""Run the `miles` app in-process and read its help text as data."""

from __future__ import annotations

import os
import re
import tempfile

from typer.testing import CliRunner

from miles_cli.main import build_app

WIDE = {"COLUMNS": "4000", "TERMINAL_WIDTH": "4000", "NO_COLOR": "1"}


def invoke(argv: list[str], env: dict[str, str] | None = None):
    """Run `miles argv` in an empty temporary directory, so relative default paths (runs/...) never
    point at a user's real runs: nothing a test invokes can find prepared models and start training."""
    runner = CliRunner()
    here = os.getcwd()
    with tempfile.TemporaryDirectory() as empty:
        os.chdir(empty)
        try:
            return runner.invoke(build_app(argv), argv, env={**WIDE, **(env or {})}, catch_exceptions=False)
        finally:
            os.chdir(here)


def error_text(output: str) -> str:
    """The error part of a command's output: what follows the options table, if one was printed."""
    end_of_table = output.rfind("└")
    return output[end_of_table:] if end_of_table >= 0 else output


_ROW = re.compile(r"^  (--[a-z0-9][a-z0-9-]*)(?: / --no-[a-z0-9-]+)?(?: [A-Z][A-Z=_.]*)?(?:  +(.*))?$")


def help_rows(output: str) -> dict[str, str]:
    """{flag: help text} for every option row of a help screen (continuation lines joined)."""
    rows: dict[str, str] = {}
    current = None
    # A `--x / --no-x` pair wider than the terminal is printed on two lines (broken after the slash).
    output = re.sub(r" /\n +(--no-[a-z0-9-]+)", r" / \1", output)
    for line in output.splitlines():
        m = _ROW.match(line)
        if m:
            current = m.group(1)
            rows[current] = (m.group(2) or "").strip()
        elif current is not None and line.startswith("    ") and line.strip():
            rows[current] = (rows[current] + " " + line.strip()).strip()
        else:
            current = None
    return rows


def shown_default(help_line: str) -> str | None:
    """The value `[default: X]` (or `[default: X; derived: RULE]`) states."""
    m = re.search(r"\[default: (.*?)(?:; derived: .*)?\]$", help_line)
    return m.group(1) if m else None


def shown_derived(help_line: str) -> str | None:
    m = re.search(r"(?:\[|; )derived: (.*)\]$", help_line)
    return m.group(1) if m else None


_TABLE_ROW = re.compile(r"^│ (--[a-z0-9-]+) +│ (.*?) +│ (.*?) +│$")


def table_rows(output: str) -> dict[str, tuple[str, str]]:
    """{flag: (value, source)} of the options table `--dry-run` prints (rendered wide, without colour)."""
    rows = {}
    for line in output.splitlines():
        m = _TABLE_ROW.match(line)
        if m:
            rows[m.group(1)] = (m.group(2), m.group(3))
    return rows


def dry_run_ok(r) -> bool:
    """`--dry-run` printed its table and passed every check, or stopped only because the prepared
    model/data of the recipe do not exist in this empty test directory (exit 2, one error line, after
    the table): the run's input checks are part of --dry-run (issue 14)."""
    if r.returncode == 0:
        return True
    errors = [line for line in r.stderr.splitlines() if line.startswith("Error:")]
    # ... or because this machine has none of the GPUs the recipe asks for (--hardware H100, ...).
    missing = ("does not exist", "asks for NVIDIA GPUs but this machine has none visible")
    return r.returncode == 2 and len(errors) == 1 and any(m in errors[0] for m in missing) and "Traceback" not in r.stderr
