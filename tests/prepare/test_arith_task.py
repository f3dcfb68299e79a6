"""The arithmetic task: right answers, a held-out eval split, deterministic, atomic."""

from __future__ import annotations

import json

import pytest

from miles.errors import UserError
from miles.prepare import is_complete
from miles.prepare.arith_task import EVAL_FILE, TRAIN_FILE, all_problems, create_arith_task, split_problems
from miles.prepare.tiny_model import TASK_CHARS


def _read(path) -> list[dict[str, str]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_default_task_is_single_digit_addition_with_right_labels(tmp_path):
    out = create_arith_task(tmp_path / "data", seed=0)
    train, evals = _read(out / TRAIN_FILE), _read(out / EVAL_FILE)
    assert (len(train), len(evals)) == (80, 20)
    assert evals[0].keys() == {"input", "label"}
    for row in train + evals:
        a, b = row["input"].removesuffix("=").split("+")
        assert len(a) == len(b) == 1 and row["label"] == str(int(a) + int(b))
    # 80 + 20 = all 100 problems, each exactly once, eval disjoint from train.
    assert len({r["input"] for r in train + evals}) == 100
    assert is_complete(out)


def test_labels_of_every_operator():
    rows = {r["input"]: r["label"] for r in all_problems(["+", "-", "*"], 9)}
    assert len(rows) == 300
    assert rows["7+8="] == "15" and rows["3-9="] == "-6" and rows["9*9="] == "81" and rows["0*5="] == "0"
    assert all(set(k + v) <= set(TASK_CHARS) for k, v in rows.items())
    with pytest.raises(UserError, match="operator"):
        all_problems(["/"], 9)


def test_more_train_rows_than_problems_cycle_without_touching_eval():
    problems = all_problems(["+"], 4)  # 25 problems
    train, evals = split_problems(problems, seed=3, n_train=50, n_eval=5)
    eval_inputs = {r["input"] for r in evals}
    assert len(eval_inputs) == 5 and not eval_inputs & {r["input"] for r in train}
    # Two full passes over the 20 remaining problems, then 10 more: nothing repeats within a pass.
    assert len({r["input"] for r in train[:20]}) == 20
    assert len({r["input"] for r in train[20:40]}) == 20
    assert len({r["input"] for r in train[40:]}) == 10


def test_deterministic_per_seed(tmp_path):
    a = create_arith_task(tmp_path / "a", seed=7)
    b = create_arith_task(tmp_path / "b", seed=7)
    c = create_arith_task(tmp_path / "c", seed=8)
    assert (a / TRAIN_FILE).read_bytes() == (b / TRAIN_FILE).read_bytes()
    assert (a / EVAL_FILE).read_bytes() == (b / EVAL_FILE).read_bytes()
    assert (a / EVAL_FILE).read_bytes() != (c / EVAL_FILE).read_bytes()


def test_user_errors_and_skip_when_complete(tmp_path):
    with pytest.raises(UserError, match="lower n_eval"):
        create_arith_task(tmp_path / "x", n_eval=100)
    with pytest.raises(UserError, match="n_train >= 1"):
        create_arith_task(tmp_path / "x", n_train=0)
    assert not (tmp_path / "x").exists()
    out = create_arith_task(tmp_path / "d", seed=0)
    mtime = (out / TRAIN_FILE).stat().st_mtime_ns
    assert create_arith_task(out, seed=0) == out and (out / TRAIN_FILE).stat().st_mtime_ns == mtime
    with pytest.raises(UserError, match="already holds"):
        create_arith_task(out, seed=0, ops=("+", "-"))
