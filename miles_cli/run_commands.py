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
import sys
from pathlib import Path
from types import ModuleType
from typing import Annotated, Any, Literal

import typer

from miles.config.engine import OptionSpec, option_specs, specs_of
from miles.config.resolve import build_config, effective_default, resolve
from miles.config.values import format_value, parse_engine_argv, parse_scalar, split_args
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


# What `miles eval` reads: the model, how to sample, the eval datasets and how to score them. Training
# options are not flags of `eval` (they would be accepted and ignored).
EVAL_OPTIONS = frozenset(
    {
        "device", "hf_checkpoint", "rollout_backend", "rollout_temperature", "rollout_top_p", "rollout_top_k",
        "rollout_max_context_len", "rollout_max_prompt_len", "rollout_max_response_len", "rollout_stop",
        "rollout_stop_token_ids", "rollout_skip_special_tokens", "rollout_seed", "rollout_max_batch_size",
        "input_key", "label_key", "metadata_key", "tool_key", "apply_chat_template", "apply_chat_template_kwargs",
        "eval_prompt_data", "eval_input_key", "eval_label_key", "n_samples_per_eval_prompt", "eval_temperature",
        "eval_top_p", "eval_top_k", "eval_max_response_len", "rm_type", "reward_key", "eval_reward_key", "group_rm",
        "rm_url", "rm_timeout", "rm_max_retries", "custom_rm_path",
    }
)


def engine_specs_for(recipe: ModuleType, command: Command = "train") -> list[OptionSpec]:
    """Engine options exposed as flags of `command`, except those a recipe option of the same name controls."""
    taken = {s.name for s in recipe_specs(recipe)}
    return [s for s in option_specs() if s.name not in taken and (command != "eval" or s.name in EVAL_OPTIONS)]


def recipe_defaults(recipe: ModuleType) -> RecipeOptions:
    return recipe.Options().resolve()


def engine_defaults(recipe: ModuleType, plan: RecipePlan, command: Command = "train") -> dict[str, Any]:
    """The default each engine flag really has under this recipe (before derived rules)."""
    return {s.name: plan.engine.get(s.name, effective_default(s.name)) for s in engine_specs_for(recipe, command)}


@dataclasses.dataclass
class Invocation:
    """Everything a run needs, resolved: recipe options, its plan, the engine config and value sources."""

    command: Command
    recipe: ModuleType
    options: RecipeOptions
    plan: RecipePlan
    config: Any  # EngineConfig
    sources: dict[str, str]
    recipe_sources: dict[str, str] = dataclasses.field(default_factory=dict)


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
    recipe_flags = {s.flag for s in recipe_specs(recipe)}
    allowed = {s.name for s in engine_specs_for(recipe, command)}

    def parse(tokens: list[str], where: str) -> dict[str, Any]:
        values = parse_engine_argv(tokens, where=where, recipe_flags=recipe_flags)
        for name in values:
            if name not in allowed:
                flag = "--" + name.replace("_", "-")
                raise UserError(f"{flag} in {where} is not an option of `miles {command}` (it only matters when training).", option=flag)
        return values

    layers = [
        ("recipe", dict(plan.engine)),
        ("command line", cli_engine_values),
        ("--extra-args", parse(split_args(options.extra_args, where="--extra-args"), "--extra-args")),
        ("after --", parse(passthrough, "the arguments after --")),
    ]
    for source, layer in layers:
        # --num-rollout and --num-epoch are alternatives: the one given in a later layer replaces the other.
        for a, b in (("num_epoch", "num_rollout"), ("num_rollout", "num_epoch")):
            if layer.get(a) is not None and b not in layer:
                values.pop(b, None)
                sources.pop(b, None)
        values.update(layer)
        sources.update({k: source for k in layer})
    cfg = build_config(values)
    unset_derived = {s.name for s in option_specs() if s.derived is not None and cfg.get(s.name) is None}
    resolve(cfg, purpose="eval" if command == "eval" else "train")
    for s in option_specs():
        if s.name not in sources:
            sources[s.name] = "derived" if s.name in unset_derived else ("env " + s.env if s.env and cfg.get(s.name) != s.default else "default")
    return Invocation(command, recipe, options, plan, cfg, sources)


def _run_option(name: str, decl: str, annotation: Any, default: Any, help: str) -> inspect.Parameter:
    """A command option of the "Run" panel (not an engine or recipe option), its default in the help."""
    text = f"{help} \\[default: {format_value(default)}]"
    option = typer.Option(decl, help=text, rich_help_panel="Run", show_default=False)
    return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=Annotated[annotation, option])


def _source_label(source: Any) -> str:
    name = getattr(source, "name", "")
    return {"COMMANDLINE": "command line", "ENVIRONMENT": "env MILES_SCRIPT_*"}.get(name, "recipe default")


def build_run_command(command: Command, recipe: ModuleType, argv: list[str] | tuple[str, ...] = ()):
    """A Typer command function for `command` whose options are this recipe's and the engine's."""
    from miles.config.sglang import GROUPS as SGLANG_GROUPS, help_visible

    r_specs = recipe_specs(recipe)
    e_specs = engine_specs_for(recipe, command)
    r_defaults = recipe_defaults(recipe)
    e_defaults = engine_defaults(recipe, recipe.plan(r_defaults), command)
    show_sglang = help_visible(argv, e_defaults.get("rollout_backend"))

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
        params.append(make_parameter(s, e_defaults[s.name], hidden=s.group in SGLANG_GROUPS and not show_sglang))
    params.append(
        _run_option(
            "dry_run", "--dry-run/--no-dry-run", bool, False,
            "Resolve and print the options (and the prepare steps), then stop without running anything.",
        )
    )
    if command == "eval":
        params.append(
            _run_option(
                "checkpoint", "--checkpoint", str | None, None,
                "Model to evaluate: a Hugging Face directory or a miles checkpoint directory; unset = --hf-checkpoint.",
            )
        )
    recipe_names = [s.name for s in r_specs]
    engine_names = [s.name for s in e_specs]

    def run(ctx: typer.Context, **kwargs: Any) -> None:
        with user_errors_exit_2():
            options = recipe.Options(**{n: kwargs[n] for n in recipe_names})
            cli_values = commandline_values(ctx, kwargs, engine_names)
            recipe_sources = {n: _source_label(ctx.get_parameter_source(n)) for n in recipe_names}
            passthrough = list(ctx.args)
            if passthrough and "--" not in sys.argv[1:]:
                raise UserError(
                    f"Unexpected argument {passthrough[0]!r}; engine flags go after `--` or in --extra-args.",
                )
            inv = resolve_invocation(command, recipe, options, cli_values, passthrough)
            inv.recipe_sources = recipe_sources
            print_options_table(inv)
            if kwargs["dry_run"]:
                from miles_cli.output import print_plan

                print_plan(inv)
                return
            from miles_cli.execute import execute

            execute(inv, checkpoint=kwargs.get("checkpoint"))

    run.__doc__ = SUMMARIES[command]
    return with_signature(run, params)
