"""The embedded default: a tiny Qwen3 learns two-digit addition on a CPU in minutes, and RL measurably helps.

`miles full-train` with no argument runs this recipe. Prepare steps (each skipped when complete):
create a 2-layer Qwen3 with a character tokenizer (no download) → create the arithmetic task
(`a+b=` with a, b in 0..99: 2000 train rows, 200 problems held out, disjoint from train) → a short SFT
warm start with the trainer's own `sft_loss` path → GRPO with an exact-match reward, greedy eval on the
held-out split, checkpoints and MLflow in the run directory. The torch trainer reads Hugging Face
checkpoints directly, so there is no convert step.

Why this task: addition is one rule, so problems never seen in training are solvable by what the
train problems teach, and held-out accuracy moves with training reward (single-digit facts could
only be memorised, so RL could not improve the held-out ones). The SFT step count stops the warm start
at about 0.2-0.3 held-out accuracy, where sampled groups mix right and wrong answers, which is what
GRPO needs. `python bench/learning.py` measures the held-out gain of RL over the warm start.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from miles.config.fields import Derived, option
from recipes.base import PrepareStep, RecipeOptions, RecipePlan, default_run_id, recipe_default

NAME = "tiny-qwen3"
SUMMARY = "2-layer Qwen3 (~120k params) with a character tokenizer on two-digit addition; runs on a CPU."


MODEL = {"hidden_size": 64, "num_layers": 2}
"""Arguments of `create_tiny_qwen3` (the rest keep its defaults: 4 heads, 2 kv heads, MLP 256)."""
TASK = {"max_operand": 99, "n_train": 2000, "n_eval": 200, "ops": ("+",)}
"""Arguments of `create_arith_task`: two-digit addition, 2000 train rows, 200 held out."""

FULL_LR = 3e-4
LORA_LR = 2e-3
LR_RULE = Derived(
    f"{FULL_LR:g}, or {LORA_LR:g} with LoRA (--lora-rank > 0 or --lora-adapter-path)",
    # Adapters start at zero and move the weights through a rank-r product: at the full fine-tuning lr
    # a LoRA run barely leaves the warm start within the recipe's steps (measured: docs/benchmarks.md).
    lambda cfg: LORA_LR if cfg.lora.enabled else FULL_LR,
)


@dataclass
class Options(RecipeOptions):
    model_name: str = recipe_default("model_name", NAME)
    run_id: str | None = option(
        help=RecipeOptions.__dataclass_fields__["run_id"].metadata["help"],
        derived=Derived(
            "--model-name, plus -<mode> unless --mode normal, plus -seed<N> unless --prepare-seed 0",
            lambda o: default_run_id(o, **({"seed": o.prepare_seed} if o.prepare_seed else {})),
        ),
        in_eval=True,
    )
    num_gpus_per_node: int = recipe_default("num_gpus_per_node", 1)
    hardware: Literal["auto", "cpu", "H100", "H200", "B200", "GB200"] = recipe_default("hardware", "cpu")
    train_deterministic: bool = recipe_default("train_deterministic", True)
    sft_steps: int | None = option(
        help="Optimizer steps of the SFT warm start before RL.",
        derived=Derived("375, or 2 with --mode debug_minimal", lambda o: 2 if o.mode == "debug_minimal" else 375),
    )
    prepare_seed: int = option(
        0, help="Seed of the tiny model's initial weights, the task's train/held-out split and the SFT batches.",
        in_eval=True,  # names the prepared model and held-out data eval reads
    )


def plan(o: Options) -> RecipePlan:
    o.resolve()  # derived recipe options (run id, SFT steps) from their declared rules
    # Every parameter of a prepared directory is in its name: a changed option is a different
    # directory, never a stale reuse (build_once would refuse a mismatch anyway, but as an error).
    model_tag = f"tiny-qwen3-h{MODEL['hidden_size']}-l{MODEL['num_layers']}-seed{o.prepare_seed}"
    return task_plan(o, model_tag=model_tag, create_model="miles.prepare.tiny_model:create_tiny_qwen3", model_args=MODEL,
                     model_what="a random 2-layer Qwen3 and its character tokenizer")


def task_plan(o: Options, *, model_tag: str, create_model: str, model_args: dict, model_what: str) -> RecipePlan:
    """The addition task's plan for the tiny model `create_model(out_dir=..., seed=..., **model_args)`
    writes (also the plan of recipes/tiny_qwen3_moe.py); `o` already resolved."""
    steps = o.sft_steps
    seed = o.prepare_seed
    task_tag = f"arith-add{TASK['max_operand']}-train{TASK['n_train']}-eval{TASK['n_eval']}-seed{seed}"
    base_model = f"{o.model_dir}/{model_tag}"
    sft_model = f"{o.model_dir}/{model_tag}-{task_tag}-sft{steps}"
    task = f"{o.data_dir}/{task_tag}"
    debug = o.mode == "debug_minimal"
    run = o.run_dir
    engine = {
        "hf_checkpoint": sft_model,
        "prompt_data": f"{task}/train.jsonl",
        "input_key": "input",
        "label_key": "label",
        "rm_type": "exact_match",
        "num_rollout": 3 if debug else 500,
        # 32 prompts x 8 samples: with 16 prompts the early steps were noisy enough to unlearn.
        "rollout_batch_size": 32,
        "n_samples_per_prompt": 8,
        "global_batch_size": 256,
        "micro_batch_size": 256,
        "rollout_max_response_len": 4,  # up to 3 digits (99+99=198) and <|eos|>
        "rollout_skip_special_tokens": True,
        "rollout_temperature": 0.8,  # at 1.0 the sampled reward sits well below greedy accuracy
        "rollout_shuffle": True,
        "eval_prompt_data": ["arith", f"{task}/eval.jsonl"],
        "eval_interval": 2 if debug else 50,
        "eval_temperature": 0.0,
        "lr": FULL_LR,  # with LoRA: LORA_LR, by the rule in `derived` below
        "clip_grad": 1.0,
        "save": f"{run}/checkpoints",
        "load": f"{run}/checkpoints",
        "save_interval": 2 if debug else 50,
        "use_mlflow": True,
        "colocate": True,
        "check_weight_update_equal": debug,
    }
    prepare = [
        PrepareStep(
            "create-model",
            create_model,
            {"out_dir": base_model, "seed": seed, **model_args},
            f"{base_model}/.miles-complete",
            model_what,
        ),
        PrepareStep(
            "create-data",
            "miles.prepare.arith_task:create_arith_task",
            {"out_dir": task, "seed": seed, **TASK},
            f"{task}/.miles-complete",
            f"two-digit addition prompts: {TASK['n_train']} train rows, {TASK['n_eval']} problems held out for eval",
        ),
        PrepareStep(
            "sft-warm-start",
            "miles.prepare.sft_warm_start:sft_warm_start",
            {
                "base_model": base_model,
                "data": f"{task}/train.jsonl",
                "out_dir": sft_model,
                "steps": steps,
                "seed": seed,
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
    return RecipePlan(engine=engine, prepare=prepare, derived={"lr": LR_RULE})
