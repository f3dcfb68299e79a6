"""Every benchmark in one command, and one table of every ratio against its goal.

    python bench/run_all.py                 # all benchmarks at their default sizes (about 30-40 min on 2 busy cores)
    python bench/run_all.py --tiny          # every benchmark at its smoke-test size (a few minutes)
    python bench/run_all.py --only convert cli_help --json results.json

Each benchmark is its own script and runs alone as well (`python bench/<name>.py --help`); here each
runs as a subprocess with `--json`, its own output goes to the terminal as it runs, and the table
printed last collects the rows they wrote: what is compared, the ratio, the goal (issues 13, 24 and 27),
whether it is met, and the load average when that benchmark started and ended. Ratios, not absolute
times, are what to compare across machines: every baseline is measured in the same run as what it is
compared with. The RL-loop rows against TRL (steps/s, start-up, time to held-out 0.4, peak RSS of the
process tree; TRL at its default threads and at one thread) come from bench/vs_trl.py over seeds 0, 1
and 2 (each ratio's median over them, and the held-out accuracy of both sides per seed), the start-up
phases from bench/startup.py, and the asynchronous overlap's own rows from bench/async_overlap.py. The header says when and where it
ran (CPU count, load average before the run), because on a shared machine the load moves every number.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
# name -> extra arguments at the default size. Order: quick ones first.
BENCHES = {
    "cli_help": [],
    "convert": [],
    "train_step": [],
    "lora": [],
    "rollout_engine": [],
    "vs_trl": ["--seeds", "0", "1", "2"],  # learning per step over three seeds per side, and each ratio's median over them
    "step_phases": [],
    "memory_plan": [],
    "startup": [],
    "async_overlap": [],
}
# name -> arguments at the smoke-test size, for the benchmarks whose smoke-test size is not `--tiny`.
TINY = {
    "async_overlap": ["--num-rollout", "4"],  # every mode of the overlap for 4 rollouts (eval at 0 and 4)
}
# Not here: bench/learning.py (does the default run learn; minutes per seed, a pass/fail, not a ratio).


def machine() -> str:
    cpu = "unknown CPU"
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return f"{cpu}, {os.cpu_count()} cores, Python {platform.python_version()}, load average {load:.1f} at start"


def loadavg() -> float:
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")


def fmt(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.2f}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiny", action="store_true", help="every benchmark at its smoke-test size")
    ap.add_argument("--only", nargs="+", choices=list(BENCHES), default=None, help="run these benchmarks only")
    ap.add_argument("--json", type=Path, default=None, help="also write every row here")
    ap.add_argument("--timeout-s", type=float, default=3600.0, help="kill a benchmark after this long")
    a = ap.parse_args()

    started = datetime.datetime.now(datetime.timezone.utc)
    header = f"{started:%Y-%m-%d %H:%M} UTC; {machine()}; command: python bench/run_all.py {' '.join(sys.argv[1:])}".rstrip()
    print(header, flush=True)
    rows: list[dict] = []
    failed: list[str] = []
    with tempfile.TemporaryDirectory(prefix="miles-bench-") as tmp:
        for name, extra in BENCHES.items():
            if a.only and name not in a.only:
                continue
            out = Path(tmp) / f"{name}.json"
            cmd = [sys.executable, str(HERE / f"{name}.py"), *(TINY.get(name, ["--tiny"]) if a.tiny else extra), "--json", str(out)]
            print(f"\n=== {name}: {' '.join(cmd[1:])}", flush=True)
            t0, load0 = time.perf_counter(), loadavg()
            try:
                subprocess.run(cmd, check=True, timeout=a.timeout_s)
                got = json.loads(out.read_text())["rows"]
            except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError, ValueError) as e:
                failed.append(f"{name}: {e}")
                continue
            load = f"{load0:.1f}-{loadavg():.1f}"
            for r in got:
                rows.append({"bench": name, "load": load, **r})
            print(f"=== {name}: {time.perf_counter() - t0:.0f} s", flush=True)

    print(f"\n{header}")
    print(f"{'what':58} {'value':>8} {'unit':<12} {'goal':<8} {'met':<4} load (bench start-end)")
    for r in rows:
        met = {True: "yes", False: "NO", None: "-"}[r["met"]]
        print(f"{r['what']:58} {fmt(r['value']):>8} {r['unit']:<12} {r['goal'] or '-':<8} {met:<4} {r['load']}")
    for f in failed:
        print(f"FAILED {f}")
    if a.json:
        a.json.write_text(json.dumps({"header": header, "rows": rows, "failed": failed}, indent=2))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
