"""Does on-policy distillation help? Steps to held-out accuracy 0.4: GRPO alone vs GRPO + `--use-opd`.

Prepares the tiny recipe's inputs once (model, two-digit addition task, the 375-step SFT warm start)
and a stronger teacher (`miles.prepare.opd_teacher`: the warm start trained `--teacher-steps` SFT
steps further; its held-out accuracy is measured with `miles eval --checkpoint`). Then, in the same
benchmark run and from the same warm start, data and seed, one `miles full-train` per pass:

- `grpo`: the recipe as is (GRPO, exact-match reward);
- `opd`: the same plus `--use-opd --opd-type megatron --opd-teacher-load TEACHER` (the trainer
  forwards the teacher), `--opd-kl-coef` as given;
- `opd-sglang` (with `--sglang-teacher`): the teacher served by the built-in engine server instead
  (`--opd-type sglang --opd-teacher-urls`), which should learn like `opd`.

Every pass runs `--num-rollout` rollouts with a greedy held-out eval every `--eval-interval` steps (and
before the first); it prints each pass's eval curve, the first step at or above `--target` and the
wall time, and exits 1 unless `opd` reaches the target in fewer steps than `grpo`. A measurement,
not a unit test: several minutes on 2 cores.

    python bench/opd.py                              # 150 rollouts per pass, eval every 10
    python bench/opd.py --num-rollout 60 --keep /tmp/opd --sglang-teacher
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MILES = [sys.executable, "-m", "miles_cli.main"]
EVAL_KEY = "eval/arith/accuracy"


def prepare(work: Path, teacher_steps: int) -> tuple[dict, Path, float]:
    """The recipe's prepared inputs, the teacher, and the teacher's held-out accuracy."""
    from miles.prepare.opd_teacher import opd_teacher
    from miles.prepare.runner import run_prepare_steps
    from recipes.tiny_qwen3 import Options, plan

    recipe = plan(Options(model_dir=str(work / "models"), data_dir=str(work / "data"), output_dir=str(work / "runs"), run_id="unused"))
    run_prepare_steps(recipe.prepare)
    warm = recipe.engine["hf_checkpoint"]
    teacher = opd_teacher(warm_start=warm, data=recipe.engine["prompt_data"], out_dir=f"{warm}-teacher{teacher_steps}", steps=teacher_steps)
    r = subprocess.run([*MILES, "eval", *dirs(work, "teacher-eval"), "--checkpoint", str(teacher)],
                       cwd=ROOT, capture_output=True, text=True, timeout=900)
    if r.returncode != 0:
        raise RuntimeError(f"miles eval of the teacher failed:\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
    found = re.search(r"eval/arith/accuracy\s*│\s*([0-9.]+)", r.stdout)
    return recipe.engine, teacher, float(found.group(1)) if found else float("nan")


def dirs(work: Path, run_id: str) -> list[str]:
    return ["--model-dir", str(work / "models"), "--data-dir", str(work / "data"), "--output-dir", str(work / "runs"), "--run-id", run_id]


def run_pass(work: Path, name: str, extra: list[str], a) -> tuple[list[tuple[int, float]], float]:
    """One full-train; its (step, held-out accuracy) curve and wall time."""
    cmd = [*MILES, "full-train", *dirs(work, name), "--num-rollout", str(a.num_rollout), "--eval-interval", str(a.eval_interval),
           "--save-interval", str(a.num_rollout), *extra]
    log = work / f"{name}.log"
    start = time.perf_counter()
    with log.open("w") as out:
        r = subprocess.run(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, timeout=a.timeout_s)
    wall = time.perf_counter() - start
    if r.returncode != 0:
        raise RuntimeError(f"pass {name} exited {r.returncode}; log: {log}\n{log.read_text()[-3000:]}")
    rows = [json.loads(line) for line in (work / "runs" / name / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [(row["step"], row[EVAL_KEY]) for row in rows if EVAL_KEY in row], wall


def first_at(curve: list[tuple[int, float]], target: float) -> int | None:
    return next((step for step, acc in curve if acc >= target), None)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num-rollout", type=int, default=150)
    ap.add_argument("--eval-interval", type=int, default=10)
    ap.add_argument("--target", type=float, default=0.4, help="held-out accuracy to reach")
    ap.add_argument("--opd-kl-coef", type=float, default=1.0)
    ap.add_argument("--teacher-steps", type=int, default=2000, help="SFT steps of the teacher beyond the warm start")
    ap.add_argument("--sglang-teacher", action="store_true", help="also a pass with the teacher behind the built-in engine server")
    ap.add_argument("--keep", type=Path, default=None, help="write everything here instead of a deleted temporary folder")
    ap.add_argument("--timeout-s", type=float, default=1800.0, help="kill a pass after this long")
    a = ap.parse_args()

    with tempfile.TemporaryDirectory(prefix="miles-opd-") as tmp:
        work = (a.keep or Path(tmp)).resolve()
        work.mkdir(parents=True, exist_ok=True)
        engine, teacher, teacher_acc = prepare(work, a.teacher_steps)
        opd = ["--use-opd", "--opd-kl-coef", str(a.opd_kl_coef)]
        passes = {"grpo": [], "opd": [*opd, "--opd-type", "megatron", "--opd-teacher-load", str(teacher)]}
        server = None
        if a.sglang_teacher:
            server_log = work / "teacher-server.log"
            server = subprocess.Popen([sys.executable, "-m", "miles.rollout.engine.server", "--hf-checkpoint", str(teacher), "--port", "0"],
                                      cwd=ROOT, stdout=server_log.open("w"), stderr=subprocess.STDOUT,
                                      env={**os.environ, "OMP_NUM_THREADS": "1"})
            url, deadline = None, time.monotonic() + 300
            while url is None and time.monotonic() < deadline and server.poll() is None:  # it prints its URL once bound
                found = re.search(r"(http://127\.0\.0\.1:\d+)", server_log.read_text())
                url = found.group(1) if found else time.sleep(0.5)
            if url is None:
                raise RuntimeError(f"the teacher's engine server never printed its URL; log: {server_log}")
            passes["opd-sglang"] = [*opd, "--opd-type", "sglang", "--opd-teacher-urls", url]
        try:
            results = {name: run_pass(work, name, extra, a) for name, extra in passes.items()}
        finally:
            if server is not None:
                server.terminate()
                server.wait(timeout=30)

    print(f"\nteacher: the warm start + {a.teacher_steps} SFT steps, held-out accuracy {teacher_acc:.3f}; "
          f"{a.num_rollout} rollouts per pass, eval every {a.eval_interval}, --opd-kl-coef {a.opd_kl_coef}")
    print(f"{'pass':>10} {'steps to ' + str(a.target):>12} {'final acc':>9} {'wall s':>7}  curve (step:acc)")
    for name, (curve, wall) in results.items():
        hit = first_at(curve, a.target)
        shown = " ".join(f"{s}:{acc:.3f}" for s, acc in curve)
        print(f"{name:>10} {('-' if hit is None else str(hit)):>12} {curve[-1][1]:>9.3f} {wall:>7.1f}  {shown}")
    grpo, opd_hit = first_at(results["grpo"][0], a.target), first_at(results["opd"][0], a.target)
    ok = opd_hit is not None and (grpo is None or opd_hit < grpo)
    print(f"goal (opd reaches {a.target} in fewer steps than grpo): {'met' if ok else 'NOT met'}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
