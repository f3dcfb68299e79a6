"""What every recipe is: a dataclass of recipe options and a pure `plan()` from options to a run.

A recipe only describes. `plan(options)` returns a `RecipePlan`: the engine option values the recipe
sets (by field name; the command line, `--extra-args` and `--` override them), environment variables
for the run, and the prepare steps `miles full-train` runs before training, each guarded by a
sentinel so a rerun skips what is complete. A recipe option that is the user-facing name of an
engine option (`--num-gpus-per-node` for `--actor-num-gpus-per-node`, `--train-deterministic` for
`--deterministic-mode`) declares it with `engine=`: the value reaches the engine through that one
declaration, never through `plan()`, and the engine flag is not offered next to it. The steps name functions in `miles/` by import path, so
importing a recipe stays as cheap as `miles --help` needs.

Recipe options become CLI flags with the same generator as engine options (`--x/--no-x` for bools,
choices for Literal) and can also be set with `MILES_SCRIPT_<FIELD>` environment variables (the command
line wins).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

from miles.config.fields import Derived, option
from miles.config.train import TrainConfig

ENV_PREFIX = "MILES_SCRIPT_"


@dataclass(frozen=True)
class PrepareStep:
    """One prepare step of `miles full-train`: `function(**kwargs)` unless `sentinel` already exists."""

    name: str
    function: str  # "package.module:function"
    kwargs: dict[str, Any]
    sentinel: str  # a file the step writes last; its presence means the step is complete
    description: str = ""


@dataclass
class RecipePlan:
    engine: dict[str, Any]
    env: dict[str, str] = field(default_factory=dict)
    prepare: list[PrepareStep] = field(default_factory=list)
    derived: dict[str, Derived] = field(default_factory=dict)
    """Engine values the recipe computes from other engine options, `{field: Derived(text, rule)}`:
    `rule(config)` runs on the configuration built from every layer (so it sees `--lora-rank` given on
    the command line) and replaces the recipe's plain value in `engine`, unless a later layer set the
    option; help shows the value with `text`. `engine` keeps the plain value for readers of the plan."""


def recipe_default(name: str, default: Any, *, help: str | None = None) -> Any:
    """Redeclare a shared recipe option in a recipe with another default (and optionally other help),
    keeping everything else its declaration says (the engine option it sets, its rule)."""
    base = RecipeOptions.__dataclass_fields__[name]
    metadata = dict(base.metadata)
    if help is not None:
        metadata["help"] = help
    return field(default=default, metadata=metadata)


def default_run_id(options: "RecipeOptions", **distinct: object) -> str:
    """`<model-name>[-<mode>][-<key><value>...]`: the default run id carries what makes runs different
    (the mode, and the `distinct` recipe options a recipe passes when they differ from their default),
    so a debug run and a normal run never share a directory and one never resumes the other."""
    parts = [options.model_name] + ([options.mode] if options.mode != "normal" else [])
    parts += [f"{key}{value}" for key, value in distinct.items()]
    return "-".join(parts)


@dataclass
class RecipeOptions:
    """Options every recipe has. Recipes subclass this and may change defaults or add options."""

    # `in_eval=True`: `miles eval` reads the option (and offers it); the others only steer training.
    model_name: str = option(
        "tiny-qwen3", help="Recipe (model) to run; `miles <command> --model-name NAME --help` shows its defaults.", in_eval=True
    )
    mode: Literal["normal", "debug_minimal"] = option(
        "normal", help="normal runs the recipe as designed; debug_minimal runs a few steps to check the wiring.", in_eval=True
    )
    run_id: str | None = option(
        help="Name of this run; outputs go to <output-dir>/<run-id>, and rerunning with the same id resumes it.",
        derived=Derived("--model-name, plus -<mode> unless --mode normal", lambda r: default_run_id(r)),
        in_eval=True,
    )
    num_nodes: int = option(1, help="Nodes for the training actors.", engine="actor_num_nodes")
    num_gpus_per_node: int = option(
        8, help="Devices per node for the training actors (on CPU: data-parallel worker processes).",
        engine="actor_num_gpus_per_node",
    )
    hardware: Literal["auto", "cpu", "H100", "H200", "B200", "GB200"] = option(
        "auto",
        help="Where the run trains and generates: cpu forces the CPU; auto uses a visible GPU, else the CPU; a GPU "
        "name trains on GPUs and exits 2 where none is visible (--dry-run still prints its plan).",
        engine="device",
        in_eval=True,
        to_engine=lambda hardware: {"cpu": "cpu", "auto": "auto"}.get(hardware, "cuda"),
    )
    train_backend: Literal["torch", "fsdp", "megatron"] = option(
        "torch", help=TrainConfig.__dataclass_fields__["train_backend"].metadata["help"], engine="train_backend",
    )
    train_deterministic: bool = option(
        False,
        help="Deterministic training: seeded, deterministic kernels, so reruns and resumes give identical weights.",
        engine="deterministic_mode",
    )
    output_dir: str = option("runs", help="Where runs write checkpoints, metrics and plots (<output-dir>/<run-id>).", in_eval=True)
    model_dir: str = option("runs/models", help="Where prepared models live.", in_eval=True)
    data_dir: str = option("runs/data", help="Where prepared datasets live.", in_eval=True)
    extra_args: str = option(
        "", help='Engine flags appended after the recipe\'s and the command line\'s, e.g. "--lr 1e-5 --num-rollout 10"; later wins.',
        in_eval=True,
    )

    def engine_values(self) -> dict[str, Any]:
        """{engine field: value} for the recipe options that are the user-facing names of engine options."""
        out = {}
        for f in dataclasses.fields(self):
            target = f.metadata.get("engine")
            if target is not None:
                convert = f.metadata.get("to_engine")
                value = getattr(self, f.name)
                out[target] = convert(value) if convert is not None else value
        return out

    def resolve(self) -> "RecipeOptions":
        for f in dataclasses.fields(self):
            d = f.metadata.get("derived")
            if d is not None and getattr(self, f.name) is None:
                setattr(self, f.name, d.rule(self))
        return self

    @property
    def run_dir(self) -> str:
        return f"{self.output_dir}/{self.run_id}"
