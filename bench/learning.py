"""Does the embedded default learn? Held-out accuracy of the SFT warm start vs after RL, and wall time.

Runs `miles full-train` (the `tiny-qwen3` recipe, its defaults) from scratch once per seed: fresh model,
data and output directories in a temporary folder, so the wall time includes every prepare step
(model creation, task, SFT warm start) as well as Ray start-up and GRPO. The baseline is the SFT warm
start itself, measured in the same run: the step-0 greedy eval on the held-out split, before any RL
step. The result is the last eval, after the final rollout. The held-out problems are disjoint from
the train problems by construction (`miles/prepare/arith_task.py`).

    python bench/learning.py                     # seeds 0 and 1, about 3-4 minutes each on 2 cores
    python bench/learning.py --seeds 0 --keep /tmp/learning   # keep the runs to look at curves.png
    python bench/learning.py --extra-args "--num-rollout 300"  # any engine flag, passed through

It prints one row per seed (held-out accuracy before/after RL, the gain and the after/before ratio,
the mean rollout reward of the first and last 25 steps, wall time) and exits 1 when any seed misses
`--min-gain` or `--max-wall-s`. It is a measurement, not a unit test: it takes minutes.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from miles.tracking.console import progress
from recipes import tiny_qwen3

ROOT = Path(__file__).resolve().parents[1]

EVAL_KEY = "eval/arith/accuracy"
REWARD_KEY = "rollout/raw_reward"
WINDOW = 25  # rollout steps averaged for the first/last reward


@dataclass
class Result:
    seed: int
    before: float
    after: float
    reward_first: float
    reward_last: float
    wall_s: float
    n_eval: int

    @property
    def gain(self) -> float:
        return self.after - self.before


def read_metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def run_seed(seed: int, work: Path, extra_args: str, timeout_s: float, num_rollout: int) -> Result:
    """One `miles full-train` from scratch in `work/seed<seed>`; raises when it fails or times out."""
    base = work / f"seed{seed}"
    run_dir = base / "runs" / "learning"
    log = base / "full-train.log"
    base.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable, "-m", "miles_cli.main", "full-train",
        "--prepare-seed", str(seed),
        "--output-dir", str(base / "runs"), "--model-dir", str(base / "models"), "--data-dir", str(base / "data"),
        "--run-id", "learning",
    ]  # fmt: skip
    if extra_args:
        cmd += ["--extra-args", extra_args]
    start = time.perf_counter()
    with log.open("w") as out, progress() as bar:
        # Metrics lines appear once per rollout step (plus the step-0 eval); prepare shows as 0.
        task = bar.add_task(f"seed {seed}: full-train", total=num_rollout + 1)
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
        while proc.poll() is None:
            if time.perf_counter() - start > timeout_s:
                proc.kill()
                proc.wait()
                raise TimeoutError(f"miles full-train (seed {seed}) did not finish within {timeout_s:.0f} s; log: {log}")
            bar.update(task, completed=len({r["step"] for r in read_metrics(run_dir / "metrics.jsonl")}))
            time.sleep(1.0)
        bar.update(task, completed=num_rollout + 1)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"miles full-train (seed {seed}) exited {proc.returncode}; log: {log}\n{log.read_text()[-3000:]}")
    rows = read_metrics(run_dir / "metrics.jsonl")
    evals = [(r["step"], r[EVAL_KEY]) for r in rows if EVAL_KEY in r]
    rewards = [r[REWARD_KEY] for r in rows if REWARD_KEY in r]
    if not evals or evals[0][0] != 0:
        raise RuntimeError(f"seed {seed}: no step-0 eval in {run_dir / 'metrics.jsonl'} (was --skip-eval-before-train set?)")
    eval_file = next(Path(p) for p in (base / "data").glob("*/eval.jsonl"))
    return Result(
        seed=seed,
        before=evals[0][1],
        after=evals[-1][1],
        reward_first=sum(rewards[:WINDOW]) / max(1, len(rewards[:WINDOW])),
        reward_last=sum(rewards[-WINDOW:]) / max(1, len(rewards[-WINDOW:])),
        wall_s=wall,
        n_eval=len(eval_file.read_text().splitlines()),
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1], help="--prepare-seed values, one full run each")
    ap.add_argument("--extra-args", default="", help="engine flags passed to every run (default: none, the recipe as is)")
    ap.add_argument("--keep", type=Path, default=None, help="write the runs here instead of a deleted temporary folder")
    ap.add_argument("--min-gain", type=float, default=0.2, help="held-out accuracy gain of RL over SFT each seed must reach")
    ap.add_argument("--max-wall-s", type=float, default=600.0, help="wall time each run must stay under")
    ap.add_argument("--timeout-s", type=float, default=1500.0, help="kill a run after this long")
    a = ap.parse_args()

    num_rollout = tiny_qwen3.plan(tiny_qwen3.Options().resolve()).engine["num_rollout"]
    if "--num-rollout" in a.extra_args:
        parts = a.extra_args.split()
        num_rollout = int(parts[parts.index("--num-rollout") + 1])

    with tempfile.TemporaryDirectory(prefix="miles-learning-") as tmp:
        work = a.keep or Path(tmp)
        results = [run_seed(s, work, a.extra_args, a.timeout_s, num_rollout) for s in a.seeds]

    print(f"\nbaseline: the SFT warm start (step-0 greedy eval on the held-out split); {num_rollout} GRPO rollouts")
    header = f"{'seed':>4} {'n_eval':>6} {'SFT acc':>8} {'RL acc':>7} {'gain':>7} {'ratio':>6} {'reward first/last 25':>21} {'wall s':>7}"
    print(header)
    ok = True
    for r in results:
        ratio = f"{r.after / r.before:.2f}x" if r.before > 0 else "inf"
        rewards = f"{r.reward_first:.3f} -> {r.reward_last:.3f}"
        print(f"{r.seed:>4} {r.n_eval:>6} {r.before:>8.3f} {r.after:>7.3f} {r.gain:>+7.3f} {ratio:>6} {rewards:>21} {r.wall_s:>7.1f}")
        ok &= r.gain >= a.min_gain and r.wall_s <= a.max_wall_s
    print(f"goal (gain >= {a.min_gain} and wall <= {a.max_wall_s:.0f} s for every seed): {'met' if ok else 'NOT met'}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
