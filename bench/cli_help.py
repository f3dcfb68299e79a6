"""Benchmark: wall time of `miles --help` against a bare `python -c "import typer"` (the floor).

    python bench/cli_help.py [--repeats 10]

All run as fresh processes, interleaved, in the same run; the ratio is what matters (the CLI must stay
instant: it may not import torch, ray or transformers to print help). A second floor, a one-option
Typer app's `--help`, shows what rendering any Typer help costs beyond `import typer`.
See `python -X importtime -m miles_cli.main train --help` for where the rest goes (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

COMMANDS = {
    "python -c 'import typer' (baseline)": [sys.executable, "-c", "import typer"],
    # What printing any Typer help costs (typer renders it with rich: rich.markdown, rich.traceback, ...).
    "one-option Typer app --help (help floor)": [sys.executable, "-c", "import typer\ndef main(x: int = 1):\n    pass\ntyper.run(main)", "--help"],
    "miles --help": [sys.executable, "-m", "miles_cli.main", "--help"],
    "miles train --help": [sys.executable, "-m", "miles_cli.main", "train", "--help"],
    "miles docker-build --dry-run": [sys.executable, "-m", "miles_cli.main", "docker-build", "--variant", "cu13", "--image-tag", "latest", "--dry-run"],
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--tiny", action="store_true", help="one repeat (the smoke test)")
    parser.add_argument("--json", default=None, help="also write the goal rows here (bench/run_all.py reads it)")
    args = parser.parse_args()
    if args.tiny:
        args.repeats = 1
    times: dict[str, list[float]] = {name: [] for name in COMMANDS}
    for _ in range(args.repeats):
        for name, argv in COMMANDS.items():
            t0 = time.perf_counter()
            subprocess.run(argv, capture_output=True, check=True, timeout=60)
            times[name].append(time.perf_counter() - t0)
    base = statistics.median(next(iter(times.values())))
    print(f"{'command':40s} {'median s':>9s} {'× baseline':>11s}")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"{name:40s} {med:9.3f} {med / base:11.2f}")
    if args.json:
        import json
        from pathlib import Path

        r = {name: statistics.median(ts) / base for name, ts in times.items()}
        Path(args.json).write_text(json.dumps({"bench": "cli_help", "rows": [
            {"what": "miles --help vs python -c 'import typer'", "value": r["miles --help"], "unit": "x typer", "goal": "<= 1.5",
             "met": r["miles --help"] <= 1.5},
            {"what": "miles train --help vs python -c 'import typer'", "value": r["miles train --help"], "unit": "x typer", "goal": "<= 2",
             "met": r["miles train --help"] <= 2},
            {"what": "miles --help vs a one-option Typer app's --help", "value": r["miles --help"] / r["one-option Typer app --help (help floor)"],
             "unit": "x help floor", "goal": "", "met": None},
        ]}, indent=2))


if __name__ == "__main__":
    main()
