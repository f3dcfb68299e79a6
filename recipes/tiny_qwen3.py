"""The embedded default: a tiny Qwen3 learns single-digit arithmetic on a CPU in minutes.

`miles full-train` with no argument runs this recipe. Prepare steps (each skipped when complete):
create a 2-layer Qwen3 with a character tokenizer (no download) → create the arithmetic task
(train and held-out eval splits) → a short SFT warm start with the trainer's own `sft_loss` path
(GRPO from random weights learns nothing; from ~0.2-0.4 accuracy it climbs) → GRPO with an
exact-match reward, greedy eval on the held-out split, checkpoints and MLflow in the run directory.
The torch trainer reads Hugging Face checkpoints directly, so there is no convert step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from miles.config.fields import option
from recipes.base import PrepareStep, RecipeOptions, RecipePlan

NAME = "tiny-qwen3"
SUMMARY = "2-layer Qwen3 (~120k params) with a character tokenizer on single-digit arithmetic; runs on a CPU."


@dataclass
class Options(RecipeOptions):
    model_name: str = option(NAME, help=RecipeOptions.__dataclass_fields__["model_name"].metadata["help"])
    num_gpus_per_node: int = option(1, help="Training worker processes (on CPU each is one data-parallel rank).")
    hardware: Literal["auto", "cpu", "H100", "H200", "B200", "GB200"] = option(
        "cpu", help="Hardware the recipe is tuned for: cpu (auto or a GPU name runs it on a visible GPU)."
    )
    train_deterministic: bool = option(
        True, help="Deterministic training: seeded, deterministic kernels, so reruns and resumes give identical weights."
    )
    sft_steps: int = option(100, help="Optimizer steps of the SFT warm start before RL.")


def plan(o: Options) -> RecipePlan:
    base_model = f"{o.model_dir}/tiny-qwen3-base"
    steps = 2 if o.mode == "debug_minimal" else o.sft_steps
    # The step count is in the name: a different --sft-steps is a different model, never a stale reuse.
    sft_model = f"{o.model_dir}/tiny-qwen3-sft{steps}"
    task = f"{o.data_dir}/arith"
    debug = o.mode == "debug_minimal"
    run = o.run_dir
    engine = {
        "hf_checkpoint": sft_model,
        "prompt_data": f"{task}/train.jsonl",
        "input_key": "input",
        "label_key": "label",
        "rm_type": "exact_match",
        "num_rollout": 3 if debug else 300,
        "rollout_batch_size": 16,
        "n_samples_per_prompt": 8,
        "global_batch_size": 128,
        "micro_batch_size": 128,
        "rollout_max_response_len": 3,
        "rollout_skip_special_tokens": True,
        "rollout_temperature": 1.0,
        "rollout_shuffle": True,
        "eval_prompt_data": ["arith", f"{task}/eval.jsonl"],
        "eval_interval": 2 if debug else 25,
        "eval_temperature": 0.0,
        "lr": 3e-4,
        "clip_grad": 1.0,
        "save": f"{run}/checkpoints",
        "load": f"{run}/checkpoints",
        "save_interval": 2 if debug else 25,
        "use_mlflow": True,
        "actor_num_nodes": o.num_nodes,
        "actor_num_gpus_per_node": o.num_gpus_per_node,
        "num_gpus_per_node": o.num_gpus_per_node,
        "colocate": True,
        "device": "cpu" if o.hardware == "cpu" else "auto",
        "train_backend": o.train_backend,
        "deterministic_mode": o.train_deterministic,
        "check_weight_update_equal": debug,
    }
    prepare = [
        PrepareStep(
            "create-model",
            "miles.prepare.tiny_model:create_tiny_qwen3",
            {"out_dir": base_model, "seed": 0},
            f"{base_model}/.miles-complete",
            "a random 2-layer Qwen3 and its character tokenizer",
        ),
        PrepareStep(
            "create-data",
            "miles.prepare.arith_task:create_arith_task",
            {"out_dir": task, "seed": 0},
            f"{task}/.miles-complete",
            "single-digit addition prompts: 80 train problems, 20 held out for eval",
        ),
        PrepareStep(
            "sft-warm-start",
            "miles.prepare.sft_warm_start:sft_warm_start",
            {
                "base_model": base_model,
                "data": f"{task}/train.jsonl",
                "out_dir": sft_model,
                "steps": steps,
                "seed": 0,
            },
            f"{sft_model}/.miles-complete",
            "supervised warm start with --loss-type sft_loss",
        ),
    ]
    if o.train_backend == "megatron":
        prepare.append(
            PrepareStep(
                "convert",
                "miles.ckpt.convert:prepare_torch_dist",
                {"hf_checkpoint": sft_model, "save": f"{sft_model}_torch_dist"},
                f"{sft_model}_torch_dist/latest_checkpointed_iteration.txt",
                "Hugging Face → torch_dist for the megatron trainer",
            )
        )
    env = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"} if o.train_deterministic else {}
    return RecipePlan(engine=engine, env=env, prepare=prepare)
