"""Turn a `ModelRecipe` (typed data) into a recipe: an `Options` dataclass and a pure `plan()`.

The plan downloads the model and datasets from the Hugging Face Hub (each a sentinel-guarded prepare
step of `miles full-train`), points `--hf-checkpoint`/`--prompt-data`/`--eval-prompt-data` at them,
runs the rollouts on SGLang engines of `rollout_gpus_per_engine` GPUs, and sets the recipe's engine
options and environment. `--train-deterministic` adds DETERMINISTIC_ENV and `--deterministic-mode`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Literal

from miles.config.fields import option
from recipes.base import PrepareStep, RecipeOptions, RecipePlan
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
    Options = dataclasses.make_dataclass(
        "Options",
        [
            ("model_name", str, option(spec.name, help=_help("model_name"))),
            ("mode", Literal["normal", "debug_minimal"], option(spec.default_mode, help=_help("mode"))),
            ("num_nodes", int, option(spec.num_nodes, help=_help("num_nodes"))),
            ("num_gpus_per_node", int, option(spec.num_gpus_per_node, help="GPUs per node.")),
            (
                "hardware",
                Literal["auto", "cpu", "H100", "H200", "B200", "GB200"],
                option(spec.hardware, help=f"GPU the recipe's layout is tuned for (upstream: {spec.hardware})."),
            ),
            ("train_deterministic", bool, option(spec.train_deterministic, help=_help("train_deterministic"))),
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
            "actor_num_nodes": o.num_nodes,
            "actor_num_gpus_per_node": o.num_gpus_per_node,
            "colocate": spec.colocate,
            "train_backend": o.train_backend,
            "deterministic_mode": o.train_deterministic,
            "save": f"{o.run_dir}/checkpoints",
            "load": f"{o.run_dir}/checkpoints",
            **spec.engine,
        }
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
