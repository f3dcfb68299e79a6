"""One-step overlap (--train-async) with each off-policy correction, against the synchronous loop, in one pass.

Runs `miles full-train` (the tiny-qwen3 recipe) three times in one invocation, one after the other, with
the same prepared model and data (later runs reuse what the first one's prepare steps made), the same
seeds and the same rollouts: synchronous (`--no-colocate`, so every run places the engine beside the
trainer), `--train-async --use-rollout-logprobs --no-colocate` (the engine's log-probs are the PPO
ratio's denominator, so the clip bounds each step against the weights that generated the data) and
`--train-async --use-tis --no-colocate` (the trainer's log-probs over the engine's, truncated at
--tis-clip, weight each token's loss). --train-async refuses to run without one of the two. Per run: median `perf/step_time` over steps without eval or save, the
held-out gain (last greedy eval minus the step-0 eval), the wall time from the first step to the first
eval at or above 0.4, and the load average around it (a shared machine moves every number, so only the
ratios of one pass are comparable).

    python bench/async_overlap.py                              # 500 rollouts each (the recipe's)
    python bench/async_overlap.py --num-rollout 300 --json out.json
    python bench/async_overlap.py --modes sync,train_async_rlp # a subset
    python bench/async_overlap.py --baseline-src /tmp/base     # A/B: each mode from that checkout too

`--baseline-src DIR` (a miles checkout, e.g. `git worktree add /tmp/base REV`) runs every mode from DIR
as well, right before the same mode from this tree, so two versions meet the same load; the table then
also gives each row's step time over the baseline's synchronous one (e.g. the overlap against the
synchronous loop as it was before the thread policy of miles/ray/threads.py).

The ratio rows (overlapped / synchronous median step time) have issue 24's goal, <= 0.6.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EVAL_KEY = "eval/arith/accuracy"
PHASES = ("rollout", "train", "weight_sync")  # perf/<phase>_time
MODES = {  # name -> (label, flags added to the common ones)
    "sync": ("synchronous", ""),
    "train_async_rlp": ("--train-async --use-rollout-logprobs", "--train-async --use-rollout-logprobs"),
    "train_async_tis": ("--train-async --use-tis", "--train-async --use-tis"),
}


def _merged(path: Path) -> dict[int, dict]:
    steps: dict[int, dict] = {}
    for line in path.read_text().splitlines():
        if line.strip():
            r = json.loads(line)
            steps.setdefault(r["step"], {}).update(r)
    return steps


def summarize(path: Path) -> dict:
    steps = _merged(path)
    def phase(key: str) -> list[float]:  # over steps without eval (whose step time holds the eval) and after the first
        return [r[key] for s, r in steps.items() if s > 1 and key in r and EVAL_KEY not in r]

    plain, idle = phase("perf/step_time"), phase("perf/trainer_idle_time")
    evals = sorted((s, r[EVAL_KEY]) for s, r in steps.items() if EVAL_KEY in r)
    elapsed, to_04 = 0.0, float("nan")
    for s in sorted(steps):
        elapsed += steps[s].get("perf/step_time", 0.0)
        if EVAL_KEY in steps[s] and s > 0 and steps[s][EVAL_KEY] >= 0.4:
            to_04 = elapsed
            break
    stale = [r["rollout/weight_staleness_mean"] for r in steps.values() if "rollout/weight_staleness_mean" in r]
    return {
        "median_step_s": statistics.median(plain),
        "median_trainer_idle_s": statistics.median(idle) if idle else float("nan"),
        # The phases, each measured where it runs: overlapped, they run at once and compete for the cores.
        **{f"median_{k}_s": statistics.median(v) if (v := phase(f"perf/{k}_time")) else float("nan") for k in PHASES},
        "eval_before": evals[0][1],
        "eval_after": evals[-1][1],
        "gain": evals[-1][1] - evals[0][1],
        "seconds_to_0.4": to_04,
        "staleness_mean": statistics.mean(stale) if stale else 0.0,
        "steps": float(len(plain)),
        "evals": {str(s): v for s, v in evals},  # the held-out curve (step -> accuracy), for the record
    }


def run(name: str, work: Path, extra: str, timeout_s: float, src: Path = ROOT) -> dict[str, float]:
    out = work / name
    cmd = [
        sys.executable, "-m", "miles_cli.main", "full-train", "--run-id", name,
        "--output-dir", str(out), "--model-dir", str(work / "models"), "--data-dir", str(work / "data"),
        "--extra-args", extra,
    ]  # fmt: skip
    load0, t0 = os.getloadavg()[0], time.perf_counter()
    with (work / f"{name}.log").open("w") as log:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(src), *filter(None, [os.environ.get("PYTHONPATH")])])}
        proc = subprocess.run(cmd, cwd=src, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s)
    if proc.returncode != 0:
        raise RuntimeError(f"{name}: miles full-train exited {proc.returncode}; log: {work / f'{name}.log'}")
    result = summarize(out / name / "metrics.jsonl")
    result.update(wall_s=time.perf_counter() - t0, load_start=load0, load_end=os.getloadavg()[0])
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num-rollout", type=int, default=500)
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, from {', '.join(MODES)} (sync always runs, first: the ratios need it)")
    ap.add_argument("--extra-args", default="", help="engine flags added to every run")
    ap.add_argument("--keep", type=Path, default=None, help="write the runs here instead of a deleted temporary folder")
    ap.add_argument("--timeout-s", type=float, default=3600.0)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--baseline-src", type=Path, default=None, help="a miles checkout whose runs of every mode go right before this tree's")
    a = ap.parse_args()
    modes = [m.strip() for m in a.modes.split(",") if m.strip()]
    unknown = [m for m in modes if m not in MODES]
    if unknown or "sync" not in modes:
        ap.error(f"--modes {a.modes}: give sync and any of {', '.join(MODES)}")
    base = f"--no-colocate --num-rollout {a.num_rollout} {a.extra_args}".strip()
    results: dict[str, dict[str, float]] = {}
    baseline: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory(prefix="miles-async-") as tmp:
        work = a.keep or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        for m in ["sync", *(m for m in modes if m != "sync")]:
            if a.baseline_src is not None:
                baseline[m] = run(f"baseline_{m}", work, f"{MODES[m][1]} {base}".strip(), a.timeout_s, src=a.baseline_src.resolve())
            results[m] = run(m, work, f"{MODES[m][1]} {base}".strip(), a.timeout_s)
    sync = results["sync"]
    vs_base = f" {'/ base sync':>11}" if baseline else ""
    print(f"{'':38} {'median step s':>13} {'ratio':>6}{vs_base} {'trainer idle s':>14} {'eval 0 -> last':>15} {'gain':>6} {'s to 0.4':>9} {'staleness':>9} {'wall s':>7} {'load':>11}")
    rows = []
    table = [(m, MODES[m][0], r) for m, r in results.items()]
    table += [(f"baseline_{m}", f"baseline: {MODES[m][0]}", r) for m, r in baseline.items()]
    for m, label, r in table:
        mine = baseline["sync"] if m.startswith("baseline_") else sync
        ratio = r["median_step_s"] / mine["median_step_s"]
        over_base = f" {r['median_step_s'] / baseline['sync']['median_step_s']:>11.2f}" if baseline else ""
        print(
            f"{label:38} {r['median_step_s']:>13.3f} {ratio:>6.2f}{over_base} {r['median_trainer_idle_s']:>14.3f} {r['eval_before']:>6.3f} -> {r['eval_after']:.3f} "
            f"{r['gain']:>+6.3f} {r['seconds_to_0.4']:>9.1f} {r['staleness_mean']:>9.2f} {r['wall_s']:>7.0f} {r['load_start']:>5.1f}-{r['load_end']:<5.1f}"
        )
        if m.startswith("baseline_"):
            continue
        if m == "sync":
            rows.append({"what": "synchronous: held-out gain (same rollouts)", "value": r["gain"], "unit": "accuracy", "goal": None, "met": None})
            rows.append({"what": "synchronous: seconds to held-out 0.4", "value": r["seconds_to_0.4"], "unit": "s", "goal": None, "met": None})
            continue
        label = MODES[m][0]
        rows.append({"what": f"{label}: median step time / synchronous", "value": ratio, "unit": "x", "goal": "<= 0.6", "met": ratio <= 0.6})
        rows.append({"what": f"{label}: held-out gain", "value": r["gain"], "unit": "accuracy", "goal": ">= 0.2", "met": r["gain"] >= 0.2})
        rows.append({"what": f"{label}: seconds to held-out 0.4", "value": r["seconds_to_0.4"], "unit": "s", "goal": None, "met": None})
    print(f"\n{'phases (median s)':38} {'generate':>9} {'train':>9} {'sync':>9}   (overlapped, generate and train run at once)")
    for m, label, r in table:
        print(f"{label:38} " + " ".join(f"{r[f'median_{k}_s']:>9.3f}" for k in PHASES))
    for row in rows:
        if row["goal"]:
            print(f"{row['what']}: {row['value']:.3f} (goal {row['goal']}: {'met' if row['met'] else 'NOT met'})")
    if a.json:
        extra = {"baseline": baseline} if baseline else {}
        a.json.write_text(json.dumps({"bench": "async_overlap", **results, **extra, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
