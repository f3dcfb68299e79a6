"""Benchmark: wall time of `miles --help` and `miles train --help` against `python -c "import typer"` (the floor).

    python bench/cli_help.py [--repeats 10]

All run as fresh processes, interleaved round by round, in the same run; the ratio to the baseline
is what matters (the CLI must stay instant: it may not import torch, ray or transformers to print
help). A second floor, a one-option Typer app's `--help`, shows what rendering any Typer help costs
beyond `import typer`. The other rows show help that needs more: every option of a command, and a
recipe whose help lists SGLang's ~600 options.

Every process reads compiled bytecode, the baseline's and miles' alike: they share a fresh
`PYTHONPYCACHEPREFIX` that an unmeasured first round fills. An installed miles has bytecode as typer
has; with `PYTHONDONTWRITEBYTECODE` set (as in some development shells) miles' sixty modules would be
compiled from source at every start and typer's not, which measures the shell, not the program.
Medians of `--repeats` rounds, of wall time and of the CPU time each process used (user + system:
on a shared machine the load moves wall times far more than CPU times, so both are printed, with
the load average). Where the time goes: `python -X importtime -m miles_cli.main train --help`.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

MILES = [sys.executable, "-m", "miles_cli.main"]
BASELINE = "python -c 'import typer' (baseline)"
HELP_FLOOR = "one-option Typer app --help (help floor)"
COMMANDS = {
    BASELINE: [sys.executable, "-c", "import typer"],
    # What printing any Typer help costs (typer renders it with rich: rich.markdown, rich.traceback, ...).
    HELP_FLOOR: [sys.executable, "-c", "import typer\ndef main(x: int = 1):\n    pass\ntyper.run(main)", "--help"],
    "miles --help": [*MILES, "--help"],
    "miles train --help": [*MILES, "train", "--help"],
    "miles eval --help": [*MILES, "eval", "--help"],
    "miles train --help-all": [*MILES, "train", "--help-all"],
    "miles train --model-name qwen3-4b --help": [*MILES, "train", "--model-name", "qwen3-4b", "--help"],
    "miles docker-build --dry-run": [*MILES, "docker-build", "--variant", "cu13", "--image-tag", "latest", "--dry-run"],
}


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--tiny", action="store_true", help="one repeat (the smoke test)")
    parser.add_argument("--json", default=None, help="also write the goal rows here (bench/run_all.py reads it)")
    args = parser.parse_args()
    if args.tiny:
        args.repeats = 1
    times: dict[str, list[float]] = {name: [] for name in COMMANDS}
    cpu: dict[str, list[float]] = {name: [] for name in COMMANDS}
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="miles-cli-bench-pycache-") as cache:
        env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
        env["PYTHONPYCACHEPREFIX"] = cache
        for round_ in range(args.repeats + 1):  # round 0 writes the bytecode and is not counted
            for name, argv in COMMANDS.items():
                c0, t0 = _children_cpu(), time.perf_counter()
                subprocess.run(argv, capture_output=True, check=True, timeout=60, env=env)
                if round_:
                    times[name].append(time.perf_counter() - t0)
                    cpu[name].append(_children_cpu() - c0)
    base, base_cpu = statistics.median(times[BASELINE]), statistics.median(cpu[BASELINE])
    print(f"{args.repeats} rounds, medians; load average {load:.1f} before, {os.getloadavg()[0]:.1f} after")
    print(f"{'command':44s} {'wall s':>8s} {'× baseline':>11s} {'CPU s':>8s} {'× baseline':>11s}")
    for name, ts in times.items():
        med, med_cpu = statistics.median(ts), statistics.median(cpu[name])
        print(f"{name:44s} {med:8.3f} {med / base:11.2f} {med_cpu:8.3f} {med_cpu / base_cpu:11.2f}")
    if args.json:
        import json
        from pathlib import Path

        r = {name: statistics.median(ts) / base for name, ts in times.items()}
        rc = {name: statistics.median(ts) / base_cpu for name, ts in cpu.items()}
        Path(args.json).write_text(json.dumps({"bench": "cli_help", "rows": [
            {"what": "miles --help vs python -c 'import typer'", "value": r["miles --help"], "unit": "x typer", "goal": "<= 1.5",
             "met": r["miles --help"] <= 1.5},
            {"what": "miles train --help vs python -c 'import typer'", "value": r["miles train --help"], "unit": "x typer", "goal": "<= 2",
             "met": r["miles train --help"] <= 2},
            {"what": "miles --help vs a one-option Typer app's --help", "value": r["miles --help"] / r[HELP_FLOOR],
             "unit": "x help floor", "goal": "", "met": None},
            {"what": "miles train --help vs python -c 'import typer', CPU time", "value": rc["miles train --help"], "unit": "x typer",
             "goal": "", "met": None},
        ]}, indent=2))


if __name__ == "__main__":
    main()
