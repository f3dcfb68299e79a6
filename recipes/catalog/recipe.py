"""Turn a `ModelRecipe` (typed data) into a recipe: an `Options` dataclass and a pure `plan()`.

The plan downloads the model and datasets from the Hugging Face Hub (each a sentinel-guarded prepare
step of `miles full-train`), points `--hf-checkpoint`/`--prompt-data`/`--eval-prompt-data` at them,
runs the rollouts on SGLang engines of `rollout_gpus_per_engine` GPUs, and sets the recipe's engine
options and environment. The shared recipe options (`--num-nodes`, `--num-gpus-per-node`, `--hardware`,
`--train-deterministic`, ...) take the model's defaults and reach their engine options through their
own declaration (recipes/base.py), never through `plan()`; `--train-deterministic` also adds DETERMINISTIC_ENV.
The recipes train on megatron by default with upstream's layout (`ModelRecipe.megatron`) as the
megatron options' values; `--train-backend torch`/`fsdp` drops that layout (those options do not apply there).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Literal

from recipes.base import PrepareStep, RecipeOptions, RecipePlan, recipe_default
from recipes.catalog.models import DETERMINISTIC_ENV
from recipes.catalog.spec import HubFiles, ModelRecipe

_BASE = RecipeOptions.__dataclass_fields__


def module_name(recipe_name: str) -> str:
    """`qwen3-30b-a3b` -> `recipes.catalog.qwen3_30b_a3b` (`glm-4.7-flash` -> `recipes.catalog.glm_47_flash`)."""
    return "recipes.catalog." + recipe_name.replace("-", "_").replace(".", "")


def _help(name: str) -> str:
    return _BASE[name].metadata["help"]


def build(spec: ModelRecipe) -> tuple[type, Callable[[Any], RecipePlan]]:
    """(Options, plan) of the recipe described by `spec`."""
    # The shared recipe options with this model's defaults (recipe_default keeps the engine option each
    # one names: --num-nodes is --actor-num-nodes, --train-deterministic is --deterministic-mode, ...).
    Options = dataclasses.make_dataclass(
        "Options",
        [
            ("model_name", str, recipe_default("model_name", spec.name)),
            ("mode", Literal["normal", "debug_minimal"], recipe_default("mode", spec.default_mode)),
            ("num_nodes", int, recipe_default("num_nodes", spec.num_nodes)),
            ("num_gpus_per_node", int, recipe_default("num_gpus_per_node", spec.num_gpus_per_node)),
            (
                "hardware",
                Literal["auto", "cpu", "H100", "H200", "B200", "GB200"],
                recipe_default(
                    "hardware", spec.hardware, help=_help("hardware") + f" The recipe's layout is tuned for {spec.hardware} (upstream)."
                ),
            ),
            ("train_backend", Literal["torch", "fsdp", "megatron"], recipe_default("train_backend", "megatron")),
            ("train_deterministic", bool, recipe_default("train_deterministic", spec.train_deterministic)),
        ],
        bases=(RecipeOptions,),
    )
    Options.__module__ = module_name(spec.name)

    def plan(o: Any) -> RecipePlan:
        o.resolve()
        models, data = o.model_dir, o.data_dir
        model_dir = f"{models}/{spec.model.local_name}"
        engine: dict[str, Any] = {
            "hf_checkpoint": model_dir,
            "prompt_data": f"{data}/{spec.prompt_file}",
            "rollout_backend": "sglang",
            "rollout_num_gpus_per_engine": spec.rollout_gpus_per_engine,
            "colocate": spec.colocate,
            "save": f"{o.run_dir}/checkpoints",
            "load": f"{o.run_dir}/checkpoints",
            **spec.engine,
        }
        if o.train_backend == "megatron":
            engine.update(spec.megatron)  # upstream's layout: megatron options, meaningless to the other trainers
        if spec.eval_file is not None:
            engine["eval_prompt_data"] = ["aime", f"{data}/{spec.eval_file}"]
        if o.mode == "debug_minimal":
            engine.update(spec.debug_engine)
            if engine.get("eval_interval") is None:
                engine.pop("eval_interval", None)
        engine = {k: v for k, v in engine.items() if v is not None}
        env = dict(spec.env)
        if o.train_deterministic:
            env.update(DETERMINISTIC_ENV)
        prepare = [_download("download-model", spec.model, models)]
        prepare += [_download(f"download-{d.local_name}", d, data) for d in spec.datasets]
        return RecipePlan(engine=engine, env=env, prepare=prepare)

    return Options, plan


def _download(name: str, files: HubFiles, root: str) -> PrepareStep:
    local = f"{root}/{files.local_name}"
    return PrepareStep(
        name,
        "miles.prepare.hub:download",
        {"repo_id": files.repo_id, "local_dir": local, "repo_type": files.repo_type, "allow_patterns": list(files.allow_patterns)},
        f"{local}/.miles-download-complete",
        f"download {files.repo_type} {files.repo_id} from the Hugging Face Hub",
    )


def module_attrs(name: str) -> tuple[str, str, ModelRecipe, type, Callable[[Any], RecipePlan]]:
    """(NAME, SUMMARY, SPEC, Options, plan) for the recipe module of catalog entry `name`."""
    from recipes.catalog.models import RECIPES

    spec = next(r for r in RECIPES if r.name == name)
    Options, plan = build(spec)
    return spec.name, spec.summary, spec, Options, plan
