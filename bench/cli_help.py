"""Benchmark: wall time of `miles --help` against a bare `python -c "import typer"` (the floor).

    python bench/cli_help.py [--repeats 10]

Both run as fresh processes, interleaved, in the same run; the ratio is what matters (the CLI must stay
instant: it may not import torch, ray or transformers to print help).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

COMMANDS = {
    "python -c 'import typer' (baseline)": [sys.executable, "-c", "import typer"],
    "miles --help": [sys.executable, "-m", "miles_cli.main", "--help"],
    "miles train --help": [sys.executable, "-m", "miles_cli.main", "train", "--help"],
    "miles docker-build --dry-run": [sys.executable, "-m", "miles_cli.main", "docker-build", "--variant", "cu13", "--image-tag", "latest", "--dry-run"],
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
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


if __name__ == "__main__":
    main()
