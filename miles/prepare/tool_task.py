"""Create the task of the `tiny-qwen3-tools` recipe: multiplications the tiny model can only get right
with the calculator, as chat prompts, plus the SFT conversations of its warm start.

`create_tool_task(out_dir)` writes three JSONL files, every row with the calculator's tool spec under
`tools` (the chat template names it in the system block):

- `train.jsonl` / `eval.jsonl`: prompts `{"messages": [{"role": "user", "content": "123*45"}], "label":
  "5535", "tools": [...]}`, a three-digit times a two-digit number (81,000 problems); the `n_eval`
  held-out problems never appear in train rows or SFT conversations.
- `sft.jsonl`: `n_sft` conversations on train problems. A `tool_fraction` of them call the calculator
  and answer with its result; the others answer at once with the right product, which a model of
  this size cannot compute, so after the warm start the model calls the tool only sometimes and its
  direct answers are mostly wrong. GRPO then has something to learn: that calling the tool pays.

`final_answer_reward` (`--custom-rm-path miles.prepare.tool_task.final_answer_reward`) scores the
text of the model's last turn against the label, exactly (a multi-turn response also holds the tool
call and the tool's answer, which must not count as the model's answer).

Usage:

    from miles.prepare.tool_task import create_tool_task
    task = create_tool_task("runs/data/tools", seed=0, n_train=4000, n_eval=200, n_sft=2000)
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path
from typing import Any

from miles.prepare import build_once

TRAIN_FILE, EVAL_FILE, SFT_FILE = "train.jsonl", "eval.jsonl", "sft.jsonl"
ASSISTANT_OPENING = "<|im_start|>assistant\n"
"""Where the chat template opens an assistant turn; the text after the last one is the model's answer."""


def calculator_spec() -> dict[str, Any]:
    from miles.rollout.tools.builtin import TOOL_SPECS

    return next(t for t in TOOL_SPECS if t["function"]["name"] == "calculator")


def conversation(a: int, b: int, *, use_tool: bool) -> list[dict[str, Any]]:
    """The SFT conversation of `a*b`: with the calculator, or answered at once."""
    question, answer = f"{a}*{b}", str(a * b)
    if not use_tool:
        return [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
    call = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": question}}}
    return [
        {"role": "user", "content": question},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "name": "calculator", "content": answer},
        {"role": "assistant", "content": answer},
    ]


def create_tool_task(
    out_dir: str | os.PathLike[str],
    *,
    seed: int = 0,
    n_train: int = 4000,
    n_eval: int = 200,
    n_sft: int = 2000,
    tool_fraction: float = 0.3,
) -> Path:
    """Write `train.jsonl`, `eval.jsonl` and `sft.jsonl` to `out_dir` (atomically) and return its path.

    Skipped when `out_dir` is already complete with the same arguments; a complete directory built
    with other arguments raises `UserError`.
    """
    spec = {"kind": "tool-task", "seed": seed, "n_train": n_train, "n_eval": n_eval, "n_sft": n_sft,
            "tool_fraction": tool_fraction}

    def build(tmp: Path) -> None:
        rng = random.Random(seed)
        problems = [(a, b) for a in range(100, 1000) for b in range(10, 100)]
        rng.shuffle(problems)
        held_out, pool = problems[:n_eval], problems[n_eval:]
        tools = [calculator_spec()]

        def prompt(a: int, b: int) -> dict[str, Any]:
            return {"messages": [{"role": "user", "content": f"{a}*{b}"}], "label": str(a * b), "tools": tools}

        def write(name: str, rows: list[dict[str, Any]]) -> None:
            (tmp / name).write_text("".join(json.dumps(r) + "\n" for r in rows))

        write(TRAIN_FILE, [prompt(*p) for p in pool[:n_train]])
        write(EVAL_FILE, [prompt(*p) for p in held_out])
        sft = pool[n_train : n_train + n_sft]  # other train-side problems: the RL prompts are new to the model
        write(SFT_FILE, [{"messages": conversation(a, b, use_tool=rng.random() < tool_fraction), "tools": tools} for a, b in sft])

    return build_once(out_dir, spec, build, what="tool-calling task")


def final_answer(response: str) -> str:
    """The model's last turn of a multi-turn response: the text after the last assistant opening."""
    return response.rsplit(ASSISTANT_OPENING, 1)[-1].replace("<|im_end|>", "").strip()


def final_answer_reward(args: Any, sample: Any) -> float:
    """1.0 when the model's last turn is exactly the label, else 0.0."""
    return 1.0 if final_answer(sample.response or "") == str(sample.label).strip() else 0.0
