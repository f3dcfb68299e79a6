"""Qwen3 dense models from a Hugging Face directory on disk (no download), on math prompts.

For a real model on a GPU node (it also runs, slowly, on a CPU). Put the model in
`<model-dir>/<hf-name>` (e.g. runs/models/Qwen3-0.6B) and the prompts in `--prompt-data`; `miles
full-train` checks both exist and says what is missing. Rewards use the `math` verifier.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from miles.config.fields import option
from recipes.base import PrepareStep, RecipeOptions, RecipePlan, recipe_default

NAME = "qwen3-0.6b"
SUMMARY = "Qwen3-0.6B from a local Hugging Face directory, GRPO on math prompts (GPU recommended)."
HF_NAMES = {"qwen3-0.6b": "Qwen3-0.6B"}


@dataclass
class Options(RecipeOptions):
    model_name: str = recipe_default("model_name", NAME)
    prompt_file: str = option("dapo-math-17k.jsonl", help="Prompt file inside --data-dir (JSONL with prompt and label keys).")
    eval_file: str = option("aime-2024.jsonl", help="Eval file inside --data-dir (JSONL with prompt and label keys).", in_eval=True)
    task: Literal["math"] = option("math", help="Task: math prompts scored by the math verifier.", in_eval=True)


def plan(o: Options) -> RecipePlan:
    o.resolve()  # derived recipe options (run id, SFT steps) from their declared rules
    hf_dir = f"{o.model_dir}/{HF_NAMES[o.model_name]}"
    debug = o.mode == "debug_minimal"
    run = o.run_dir
    engine = {
        "hf_checkpoint": hf_dir,
        "prompt_data": f"{o.data_dir}/{o.prompt_file}",
        "input_key": "prompt",
        "label_key": "label",
        "apply_chat_template": True,
        "rm_type": "math",
        "num_rollout": 2 if debug else 3000,
        # debug: 8 prompts x 8 samples = one whole group per worker on 8 workers (groups must not split)
        "rollout_batch_size": 8 if debug else 32,
        "n_samples_per_prompt": 8,
        "global_batch_size": 64 if debug else 256,
        "rollout_max_response_len": 64 if debug else 8192,
        "rollout_temperature": 1.0,
        "rollout_shuffle": True,
        "eval_prompt_data": ["aime", f"{o.data_dir}/{o.eval_file}"],
        "eval_interval": 20,
        "n_samples_per_eval_prompt": 1 if debug else 16,
        "eps_clip_high": 0.28,
        "lr": 1e-6,
        "weight_decay": 0.1,
        "adam_beta2": 0.98,
        "save": f"{run}/checkpoints",
        "load": f"{run}/checkpoints",
        "save_interval": 20,
        "colocate": True,
    }
    prepare = [
        PrepareStep(
            "check-model",
            "miles.prepare.inputs:require_hf_dir",
            {"path": hf_dir, "flag": "--model-dir"},
            f"{hf_dir}/config.json",
            "the Hugging Face model must already be on disk",
        ),
    ]
    return RecipePlan(engine=engine, prepare=prepare)
