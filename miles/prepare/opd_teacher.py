"""A stronger tiny teacher for on-policy distillation on the embedded task: the SFT warm start trained further.

The tiny recipe's warm start (`sft_warm_start`, 375 steps) sits near 0.2 held-out accuracy on
purpose, so GRPO has mixed groups to learn from. A teacher for `--use-opd` must know more than the
student, in the student's vocabulary: this step continues supervised training from the warm start
itself (`steps` more SFT steps through the same trainer path, fresh batches drawn with `seed`) and
writes the result as a Hugging Face directory (atomically, the `.miles-complete` sentinel last), to
pass as `--opd-teacher-load` (or to serve with `python -m miles.rollout.engine.server` for
`--opd-type sglang`). Its held-out accuracy is measured by `miles eval --checkpoint DIR`
(bench/opd.py prints it).

    python -m miles.prepare.opd_teacher --warm-start runs/models/...-sft375 \
        --data runs/data/arith-.../train.jsonl --out runs/models/...-sft375-teacher2000
"""

from __future__ import annotations

import argparse
from pathlib import Path

from miles.prepare.sft_warm_start import sft_warm_start

DEFAULT_STEPS = 2000
"""More SFT steps on top of the warm start's 375: about 2 minutes on one CPU thread."""


def opd_teacher(*, warm_start: str, data: str, out_dir: str, steps: int = DEFAULT_STEPS, seed: int = 1) -> Path:
    """Train the warm start `warm_start` for `steps` more SFT steps on `data` and write it to `out_dir`.

    `seed` draws other batches than the warm start's (seed 0). Skipped when `out_dir` is already
    complete with the same arguments (`build_once`)."""
    return sft_warm_start(base_model=warm_start, data=data, out_dir=out_dir, steps=steps, seed=seed)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--warm-start", required=True, help="the tiny recipe's SFT warm start (a Hugging Face directory)")
    p.add_argument("--data", required=True, help="the task's train.jsonl (input/label rows)")
    p.add_argument("--out", required=True, help="the teacher's directory")
    p.add_argument("--steps", type=int, default=DEFAULT_STEPS, help="further SFT steps")
    p.add_argument("--seed", type=int, default=1)
    a = p.parse_args(argv)
    print(opd_teacher(warm_start=a.warm_start, data=a.data, out_dir=a.out, steps=a.steps, seed=a.seed))


if __name__ == "__main__":
    main()
