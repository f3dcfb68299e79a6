"""The tiny-qwen3 recipe's prepare plan: directory names carry every parameter, the task fits the engine."""

from __future__ import annotations

import json

from miles.prepare.arith_task import EVAL_FILE, TRAIN_FILE, all_problems, create_arith_task
from miles.prepare.tiny_model import TASK_CHARS
from recipes import tiny_qwen3


def steps_of(**options) -> dict[str, dict]:
    plan = tiny_qwen3.plan(tiny_qwen3.Options(**options).resolve())
    return {step.name: step.kwargs for step in plan.prepare} | {"engine": plan.engine}


def test_every_prepared_directory_changes_with_its_parameters():
    base = steps_of()
    other_steps = steps_of(sft_steps=base["sft-warm-start"]["steps"] + 1)
    other_seed = steps_of(prepare_seed=1)
    # Another SFT step count: same base model and task, another SFT directory.
    assert other_steps["create-model"]["out_dir"] == base["create-model"]["out_dir"]
    assert other_steps["create-data"]["out_dir"] == base["create-data"]["out_dir"]
    assert other_steps["sft-warm-start"]["out_dir"] != base["sft-warm-start"]["out_dir"]
    # Another seed: every directory differs, and the seed reaches every step.
    for name in ("create-model", "create-data", "sft-warm-start"):
        assert other_seed[name]["out_dir"] != base[name]["out_dir"], name
        assert (base[name]["seed"], other_seed[name]["seed"]) == (0, 1), name
    # debug_minimal trains 2 SFT steps: its model must not be the full run's.
    assert steps_of(mode="debug_minimal")["sft-warm-start"]["out_dir"] != base["sft-warm-start"]["out_dir"]


def test_the_run_trains_and_evaluates_what_the_prepare_steps_write():
    s = steps_of()
    engine, task_dir = s["engine"], s["create-data"]["out_dir"]
    assert engine["hf_checkpoint"] == s["sft-warm-start"]["out_dir"]
    assert s["sft-warm-start"]["base_model"] == s["create-model"]["out_dir"]
    assert engine["prompt_data"] == s["sft-warm-start"]["data"] == f"{task_dir}/{TRAIN_FILE}"
    assert engine["eval_prompt_data"] == ["arith", f"{task_dir}/{EVAL_FILE}"]


def test_response_budget_fits_the_longest_answer_and_eos():
    task = {k: v for k, v in steps_of()["create-data"].items() if k not in ("out_dir", "seed", "n_train", "n_eval")}
    problems = all_problems(task["ops"], task["max_operand"])
    longest = max(len(p["label"]) for p in problems)  # one token per character
    assert longest == 3  # 99+99=198
    assert steps_of()["engine"]["rollout_max_response_len"] >= longest + 1
    assert all(set(p["input"] + p["label"]) <= set(TASK_CHARS) for p in problems)


def test_recipe_task_holds_out_enough_problems_disjoint_from_train(tmp_path):
    kwargs = steps_of()["create-data"] | {"out_dir": tmp_path / "task"}
    out = create_arith_task(**kwargs)
    train = [json.loads(x) for x in (out / TRAIN_FILE).read_text().splitlines()]
    evals = [json.loads(x) for x in (out / EVAL_FILE).read_text().splitlines()]
    assert len(train) == kwargs["n_train"] and len(evals) == kwargs["n_eval"] >= 100
    eval_inputs = {r["input"] for r in evals}
    assert len(eval_inputs) == len(evals)
    assert not eval_inputs & {r["input"] for r in train}
    for row in train + evals:
        a, b = row["input"].removesuffix("=").split("+")
        assert row["label"] == str(int(a) + int(b))
    # Two-digit operands really occur on both sides (the skill is multi-digit, not memorised facts).
    assert any(len(r["input"].split("+")[0]) == 2 and len(r["label"]) == 3 for r in evals)
