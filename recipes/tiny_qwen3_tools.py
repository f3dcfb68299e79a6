"""A tiny Qwen3 learns, with GRPO on a CPU, to call the calculator for multiplications it cannot do itself.

`miles full-train --model-name tiny-qwen3-tools`. Prepare steps (each skipped when complete): create a
2-layer Qwen3 with the chat variant of the character tokenizer (Qwen3's tool tags, a chat template that
takes `tools=`, and the calculator call's JSON as a few tokens: `tiny_model.TOOL_WORDS`) → create the task
(`miles.prepare.tool_task`: `123*45`-style prompts, a three-digit times a two-digit number, 200 held
out) → a short SFT warm start on tool conversations with `--loss-type sft_loss`'s own path (the loss
on assistant tokens only; `sft_conversation_warm_start`) → GRPO with `multi_turn.generate`: the model's
`<tool_call>` is run by the built-in calculator, its answer comes back as a tool message, and the reward
is an exact match of the model's last turn (`tool_task.final_answer_reward`). Greedy eval on the
held-out prompts, multi-turn too.

Why it needs the tool: a model of this size does not learn three-by-two-digit products in minutes, so
a direct answer is almost always wrong; copying the expression into a call and the result into the
answer is learnable. Most SFT conversations answer directly (`TASK["tool_fraction"]` use the tool), so
the warm start calls the tool only sometimes; GRPO raises the tool-call rate (rollout/tool_call_rate)
and with it the held-out accuracy. Numbers: docs/benchmarks.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from miles.config.fields import Derived, option
from miles.prepare.tiny_model import TOOL_WORDS
from recipes.base import PrepareStep, RecipeOptions, RecipePlan, default_run_id, recipe_default

NAME = "tiny-qwen3-tools"
SUMMARY = "2-layer Qwen3 with a chat tokenizer learns to call the calculator for 3-by-2-digit products; multi-turn GRPO on a CPU."

MODEL = {"hidden_size": 64, "num_layers": 2}
"""Arguments of `create_tiny_qwen3` besides `chat=True` and `chat_words=TOOL_WORDS`."""
TASK = {"n_train": 4000, "n_eval": 200, "n_sft": 2000, "tool_fraction": 0.3}
"""Arguments of `create_tool_task`."""
SFT = {"batch_size": 64, "lr": 3e-3}
"""Arguments of `sft_conversation_warm_start` besides the step count."""


@dataclass
class Options(RecipeOptions):
    model_name: str = recipe_default("model_name", NAME)
    run_id: str | None = option(
        help=RecipeOptions.__dataclass_fields__["run_id"].metadata["help"],
        derived=Derived(
            "--model-name, plus -<mode> unless --mode normal, plus -seed<N> unless --prepare-seed 0",
            lambda o: default_run_id(o, **({"seed": o.prepare_seed} if o.prepare_seed else {})),
        ),
    )
    num_gpus_per_node: int = recipe_default("num_gpus_per_node", 1)
    hardware: Literal["auto", "cpu", "H100", "H200", "B200", "GB200"] = recipe_default("hardware", "cpu")
    train_deterministic: bool = recipe_default("train_deterministic", True)
    sft_steps: int | None = option(
        help="Optimizer steps of the SFT warm start on tool conversations before RL.",
        derived=Derived("300, or 2 with --mode debug_minimal", lambda o: 2 if o.mode == "debug_minimal" else 300),
    )
    prepare_seed: int = option(
        0, help="Seed of the tiny model's initial weights, the task's problems and split, and the SFT batches."
    )


def plan(o: Options) -> RecipePlan:
    o.resolve()
    steps, seed = o.sft_steps, o.prepare_seed
    model_tag = f"tiny-qwen3-tools-h{MODEL['hidden_size']}-l{MODEL['num_layers']}-seed{seed}"
    task_tag = (f"tools-mul-train{TASK['n_train']}-eval{TASK['n_eval']}-sft{TASK['n_sft']}-tool{TASK['tool_fraction']:g}"
                f"-seed{seed}")
    base_model = f"{o.model_dir}/{model_tag}"
    sft_model = f"{o.model_dir}/{model_tag}-{task_tag}-sft{steps}-lr{SFT['lr']:g}"
    task = f"{o.data_dir}/{task_tag}"
    debug = o.mode == "debug_minimal"
    run = o.run_dir
    engine = {
        "hf_checkpoint": sft_model,
        "prompt_data": f"{task}/train.jsonl",
        "input_key": "messages",
        "label_key": "label",
        "tool_key": "tools",
        "apply_chat_template": True,
        "custom_generate_function_path": "miles.rollout.generate_hub.multi_turn.generate",
        # a call, then the answer that reads its result; a third turn would only repeat a call
        "generate_max_turns": 2,
        "custom_rm_path": "miles.prepare.tool_task.final_answer_reward",
        "num_rollout": 3 if debug else 30,
        "rollout_batch_size": 16,
        "n_samples_per_prompt": 8,
        "global_batch_size": 128,
        "micro_batch_size": 128,
        "rollout_max_response_len": 16,  # per turn: a call is 13 tokens with its eos, an answer at most 6
        "rollout_skip_special_tokens": True,
        "rollout_temperature": 1.0,
        "rollout_shuffle": True,
        "eval_prompt_data": ["tools", f"{task}/eval.jsonl"],
        "eval_interval": 2 if debug else 10,
        "eval_temperature": 0.0,
        "lr": 1e-3,
        "clip_grad": 1.0,
        "save": f"{run}/checkpoints",
        "load": f"{run}/checkpoints",
        "save_interval": 2 if debug else 10,
        "use_mlflow": True,
        "colocate": True,
    }
    prepare = [
        PrepareStep(
            "create-model",
            "miles.prepare.tiny_model:create_tiny_qwen3",
            {"out_dir": base_model, "seed": seed, "chat": True, "chat_words": list(TOOL_WORDS), **MODEL},
            f"{base_model}/.miles-complete",
            "a random 2-layer Qwen3 and its chat tokenizer (tool tags, a chat template with tools)",
        ),
        PrepareStep(
            "create-data",
            "miles.prepare.tool_task:create_tool_task",
            {"out_dir": task, "seed": seed, **TASK},
            f"{task}/.miles-complete",
            f"3-by-2-digit multiplication prompts ({TASK['n_eval']} held out) and {TASK['n_sft']} SFT conversations",
        ),
        PrepareStep(
            "sft-warm-start",
            "miles.prepare.sft_warm_start:sft_conversation_warm_start",
            {"base_model": base_model, "data": f"{task}/sft.jsonl", "out_dir": sft_model, "steps": steps, "seed": seed, **SFT},
            f"{sft_model}/.miles-complete",
            "supervised warm start on the conversations with --loss-type sft_loss (assistant tokens only)",
        ),
    ]
    return RecipePlan(engine=engine, prepare=prepare)
