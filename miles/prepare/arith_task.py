"""Create the embedded default task: arithmetic prompts with exact answers, a train and a held-out split.

`create_arith_task(out_dir)` writes `train.jsonl` and `eval.jsonl`, one JSON object a line:

    {"input": "3+5=", "label": "8"}

The problem space is every `a<op>b` with operands in `0..max_operand` and ops from `ops` (single-digit
addition by default: 100 problems; the tiny recipe uses `max_operand=99`: 10,000 two-digit additions,
answers of 1-3 digits). The problems are shuffled with `seed`; the first `n_eval` become
the eval split, and train rows are drawn only from the rest, so eval is held out by construction (no
train prompt ever equals an eval prompt). When `n_train` exceeds the remaining problems, train cycles
through them, reshuffled on each pass (every problem appears before any appears again).

Rewards use `--rm-type exact_match` against `label`; the prompt ends at `=` and the model is expected
to answer with the digits and `<|eos|>`. Every character is in the tiny tokenizer's vocabulary
(`miles.prepare.tiny_model.TASK_CHARS`). It is a toy to show learning on a CPU, not a benchmark.

Usage:

    from miles.prepare.arith_task import create_arith_task
    data_dir = create_arith_task("runs/tiny/data", seed=0)   # train.jsonl, eval.jsonl; skipped when complete
    create_arith_task("runs/tiny/add99", max_operand=99, n_train=2000, n_eval=200)   # the recipe's task
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path
from typing import Iterable, Sequence

from miles.errors import UserError
from miles.prepare import build_once

_APPLY = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}

TRAIN_FILE = "train.jsonl"
EVAL_FILE = "eval.jsonl"


def all_problems(ops: Sequence[str], max_operand: int) -> list[dict[str, str]]:
    """Every distinct problem, in a fixed order: {"input": "a<op>b=", "label": str(result)}."""
    unknown = [op for op in ops if op not in _APPLY]
    if unknown:
        raise UserError(f"unknown arithmetic operator(s) {unknown}; use some of {sorted(_APPLY)}.")
    return [
        {"input": f"{a}{op}{b}=", "label": str(_APPLY[op](a, b))}
        for op in ops
        for a in range(max_operand + 1)
        for b in range(max_operand + 1)
    ]


def split_problems(
    problems: list[dict[str, str]], *, seed: int, n_train: int, n_eval: int
) -> tuple[list[dict[str, str]], list[dict[str, str]]]:
    """(train rows, eval rows): eval = `n_eval` distinct problems; train drawn from the others only."""
    if n_eval < 1 or n_train < 1:
        raise UserError(f"the arithmetic task needs n_train >= 1 and n_eval >= 1 (got {n_train}, {n_eval}).")
    if n_eval >= len(problems):
        raise UserError(
            f"n_eval={n_eval} leaves no problem for training out of {len(problems)}; "
            "lower n_eval or raise max_operand."
        )
    rng = random.Random(seed)
    order = list(problems)
    rng.shuffle(order)
    eval_rows, pool = order[:n_eval], order[n_eval:]
    train_rows: list[dict[str, str]] = []
    while len(train_rows) < n_train:
        rng.shuffle(pool)
        train_rows.extend(pool[: n_train - len(train_rows)])
    return train_rows, eval_rows


def _write_jsonl(path: Path, rows: Iterable[dict[str, str]]) -> None:
    with path.open("w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def create_arith_task(
    out_dir: str | os.PathLike[str],
    *,
    seed: int = 0,
    n_train: int = 80,
    n_eval: int = 20,
    ops: Sequence[str] = ("+",),
    max_operand: int = 9,
) -> Path:
    """Write `train.jsonl` and `eval.jsonl` to `out_dir` (atomically) and return its path.

    Skipped when `out_dir` is already complete with the same arguments; a complete directory built
    with other arguments raises `UserError`.
    """
    spec = {
        "kind": "arith",
        "seed": seed,
        "n_train": n_train,
        "n_eval": n_eval,
        "ops": list(ops),
        "max_operand": max_operand,
    }
    train_rows, eval_rows = split_problems(
        all_problems(ops, max_operand), seed=seed, n_train=n_train, n_eval=n_eval
    )

    def build(tmp: Path) -> None:
        _write_jsonl(tmp / TRAIN_FILE, train_rows)
        _write_jsonl(tmp / EVAL_FILE, eval_rows)

    return build_once(out_dir, spec, build, what="arithmetic task")
