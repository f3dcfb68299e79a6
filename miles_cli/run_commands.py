"""`miles full-train`, `miles train` and `miles eval`: recipe + engine options → resolved config → run.

The options of these commands are generated for the recipe chosen by `--model-name` (read before the
command is built, so `--help` shows that recipe's defaults). Engine values are layered, later wins:
the recipe's plan, the engine flags given on the command line, `--extra-args`, then the tokens after
`--`. The resolved options are printed as a table before anything starts; `--dry-run` stops there
(and lists the prepare steps). The heavy work is imported only when it runs.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import shlex
import sys
from pathlib import Path
from types import ModuleType
from typing import Annotated, Any, Literal

import typer

from miles.config.engine import OptionSpec, option_specs, specs_of
from miles.config.resolve import build_config, effective_default, resolve
from miles.config.values import parse_engine_argv, parse_scalar
from miles.errors import UserError
from miles_cli.errors import user_errors_exit_2
from miles_cli.output import print_options_table
from miles_cli.params import commandline_values, make_parameter, with_signature
from recipes.base import ENV_PREFIX, RecipeOptions, RecipePlan

Command = Literal["full-train", "train", "eval"]

SUMMARIES: dict[Command, str] = {
    "full-train": "Prepare (create or convert checkpoints, data, warm start) and train, skipping completed steps.",
    "train": "Train from prepared checkpoints and data (RL loop with eval and checkpoints).",
    "eval": "Evaluate a model or checkpoint on the eval datasets.",
}


def recipe_specs(recipe: ModuleType) -> list[OptionSpec]:
    return specs_of(recipe.Options, "recipe", "Recipe")


def engine_specs_for(recipe: ModuleType) -> list[OptionSpec]:
    """Engine options exposed as flags: all, except those a recipe option of the same name controls."""
    taken = {s.name for s in recipe_specs(recipe)}
    return [s for s in option_specs() if s.name not in taken]


def recipe_defaults(recipe: ModuleType) -> RecipeOptions:
    return recipe.Options().resolve()


def engine_defaults(recipe: ModuleType, plan: RecipePlan) -> dict[str, Any]:
    """The default each engine flag really has under this recipe (before derived rules)."""
    return {s.name: plan.engine.get(s.name, effective_default(s.name)) for s in engine_specs_for(recipe)}


@dataclasses.dataclass
class Invocation:
    """Everything a run needs, resolved: recipe options, its plan, the engine config and value sources."""

    command: Command
    recipe: ModuleType
    options: RecipeOptions
    plan: RecipePlan
    config: Any  # EngineConfig
    sources: dict[str, str]


def resolve_invocation(
    command: Command,
    recipe: ModuleType,
    options: RecipeOptions,
    cli_engine_values: dict[str, Any],
    passthrough: list[str],
) -> Invocation:
    options.resolve()
    plan = recipe.plan(options)
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    layers = [
        ("recipe", dict(plan.engine)),
        ("command line", cli_engine_values),
        ("--extra-args", parse_engine_argv(shlex.split(options.extra_args), where="--extra-args")),
        ("after --", parse_engine_argv(passthrough, where="the arguments after --")),
    ]
    for source, layer in layers:
        values.update(layer)
        sources.update({k: source for k in layer})
    cfg = build_config(values)
    unset_derived = {s.name for s in option_specs() if s.derived is not None and cfg.get(s.name) is None}
    resolve(cfg, purpose="eval" if command == "eval" else "train")
    for s in option_specs():
        if s.name not in sources:
            sources[s.name] = "derived" if s.name in unset_derived else ("env " + s.env if s.env and cfg.get(s.name) != s.default else "default")
    return Invocation(command, recipe, options, plan, cfg, sources)


def build_run_command(command: Command, recipe: ModuleType):
    """A Typer command function for `command` whose options are this recipe's and the engine's."""
    r_specs = recipe_specs(recipe)
    e_specs = engine_specs_for(recipe)
    r_defaults = recipe_defaults(recipe)
    e_defaults = engine_defaults(recipe, recipe.plan(r_defaults))

    params: list[inspect.Parameter] = [
        inspect.Parameter("ctx", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=typer.Context),
    ]
    for s in r_specs:
        envvar = ENV_PREFIX + s.name.upper()
        # The default that applies: MILES_SCRIPT_<FIELD> when set, else the recipe's (derived ones show their rule).
        default = getattr(recipe.Options(), s.name)
        if os.environ.get(envvar):
            default = parse_scalar(s, os.environ[envvar], source=f"${envvar}")
        params.append(make_parameter(s, default, envvar=envvar))
    for s in e_specs:
        params.append(make_parameter(s, e_defaults[s.name]))
    params.append(
        inspect.Parameter(
            "dry_run",
            inspect.Parameter.KEYWORD_ONLY,
            default=False,
            annotation=Annotated[
                bool,
                typer.Option(
                    "--dry-run/--no-dry-run",
                    help="Resolve and print the options (and the prepare steps), then stop without running anything. \\[default: false]",
                    rich_help_panel="Run",
                    show_default=False,
                ),
            ],
        )
    )
    if command == "eval":
        params.append(
            inspect.Parameter(
                "checkpoint",
                inspect.Parameter.KEYWORD_ONLY,
                default=None,
                annotation=Annotated[
                    str | None,
                    typer.Option(
                        "--checkpoint",
                        help="Model to evaluate: a Hugging Face directory or a miles checkpoint directory; unset = --hf-checkpoint. \\[default: None]",
                        rich_help_panel="Run",
                        show_default=False,
                    ),
                ],
            )
        )
    recipe_names = [s.name for s in r_specs]
    engine_names = [s.name for s in e_specs]

    def run(ctx: typer.Context, **kwargs: Any) -> None:
        with user_errors_exit_2():
            options = recipe.Options(**{n: kwargs[n] for n in recipe_names})
            cli_values = commandline_values(ctx, kwargs, engine_names)
            passthrough = list(ctx.args)
            if passthrough and "--" not in sys.argv[1:]:
                raise UserError(
                    f"Unexpected argument {passthrough[0]!r}; engine flags go after `--` or in --extra-args.",
                )
            inv = resolve_invocation(command, recipe, options, cli_values, passthrough)
            print_options_table(inv)
            if kwargs["dry_run"]:
                from miles_cli.output import print_plan

                print_plan(inv)
                return
            from miles_cli.execute import execute

            execute(inv, checkpoint=kwargs.get("checkpoint"))

    run.__doc__ = SUMMARIES[command]
    return with_signature(run, params)
