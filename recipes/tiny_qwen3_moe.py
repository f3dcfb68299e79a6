"""A tiny Qwen3-MoE on the embedded default's task: two-digit addition on a CPU, experts and all.

The same prepare steps and run as `tiny-qwen3` (recipes/tiny_qwen3.py: arithmetic task, SFT warm
start, GRPO with an exact-match reward, held-out eval), on a 2-layer Qwen3-MoE instead: every layer's
MLP is 4 routed SwiGLU experts, top 2 (`create_tiny_qwen3_moe`, ~225k parameters). What it is for:
transformers 5 fuses the experts in memory while engines load them under checkpoint names
(miles/utils/hf_experts.py), and `--check-weight-update-equal` (on in this recipe at every mode)
proves after every sync that the engine holds exactly the trained experts.

On `--train-backend megatron` the recipe splits the experts over two data-parallel ranks (EP=2, two
worker processes on a CPU): each rank holds two experts and megatron-core's all-to-all dispatcher sends
every token to the rank of each expert it routes to; the weights the engine gets are gathered back into
all four experts per layer, which `--check-weight-update-equal` checks.
"""

from __future__ import annotations

from dataclasses import dataclass

from miles.config.fields import Derived, option
from recipes import tiny_qwen3
from recipes.base import RecipeOptions, RecipePlan, recipe_default

NAME = "tiny-qwen3-moe"
SUMMARY = "2-layer Qwen3-MoE (4 experts, top 2, ~225k params) on two-digit addition; runs on a CPU."

MODEL = {"hidden_size": 64, "num_layers": 2, "num_experts": 4, "experts_per_token": 2, "moe_intermediate": 128}
"""Arguments of `create_tiny_qwen3_moe`."""


@dataclass
class Options(tiny_qwen3.Options):
    model_name: str = recipe_default("model_name", NAME)
    num_gpus_per_node: int | None = option(
        help=RecipeOptions.__dataclass_fields__["num_gpus_per_node"].metadata["help"],
        derived=Derived("2 with --train-backend megatron (one rank per half of the experts), else 1",
                        lambda o: 2 if o.train_backend == "megatron" else 1),
        engine="actor_num_gpus_per_node",
    )


def plan(o: Options) -> RecipePlan:
    o.resolve()
    m = MODEL
    tag = (f"tiny-qwen3-moe-h{m['hidden_size']}-l{m['num_layers']}-e{m['num_experts']}k{m['experts_per_token']}"
           f"-f{m['moe_intermediate']}-seed{o.prepare_seed}")
    out = tiny_qwen3.task_plan(o, model_tag=tag, create_model="miles.prepare.tiny_model:create_tiny_qwen3_moe",
                               model_args=MODEL, model_what="a random 2-layer Qwen3-MoE and its character tokenizer")
    out.engine["check_weight_update_equal"] = True  # the point of this recipe: the experts reach the engine
    if o.train_backend == "megatron":
        out.engine["expert_model_parallel_size"] = 2
    return out
