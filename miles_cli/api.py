"""The Python API: resolve or start a run from Python, with the recipe and option names of the CLI.

    from miles_cli import api

    inv = api.resolve("tiny-qwen3", mode="debug_minimal", lr=1e-4)      # nothing runs
    inv.config.optimizer.lr, inv.config.data.num_rollout               # (0.0001, 3)
    api.run("tiny-qwen3", command="full-train", mode="debug_minimal")   # = `miles full-train --mode debug_minimal`

Keyword arguments are the option names of `miles <command> --help` in snake case: recipe options
(`mode`, `run_id`, `num_gpus_per_node`, ...) and engine options (`lr`, `rollout_batch_size`, ...).
`extra_args="--lr 1e-5"` and `args=["--lr", "1e-5"]` (the arguments after `--`) are parsed by the
very parser the command line uses. `MILES_SCRIPT_<FIELD>` environment variables set recipe options
as they do for the CLI. The CLI is a thin layer over this module: `miles train ...` builds its values
from the command line and calls `resolve_invocation` below, so both give the same configuration
(tests/cli/test_api.py checks it through the real program).

Layering, later wins: the recipe's plan, the recipe options that name engine options
(`--train-deterministic` → `deterministic_mode`), the command line (or keyword arguments),
`--extra-args`, then the arguments after `--`.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import os
from types import ModuleType
from typing import Any, Iterable, Literal

from miles.config.engine import EngineConfig, OptionSpec, RunContext, option_specs, specs_of
from miles.config.resolve import build_config, fill_derived, resolve as resolve_config, run_environment
from miles.config.values import parse_scalar, split_args
from miles.errors import UserError
from recipes import DEFAULT_RECIPE, get_recipe
from recipes.base import ENV_PREFIX, RecipeOptions, RecipePlan

Command = Literal["full-train", "train", "eval"]
COMMANDS: tuple[Command, ...] = ("full-train", "train", "eval")


def recipe_specs(recipe: ModuleType, command: Command | None = None) -> list[OptionSpec]:
    """The recipe options; for `eval` only those eval reads (declared `in_eval=True`): the trainer's
    layout, backend and warm start are not options of an eval."""
    specs = specs_of(recipe.Options, "recipe", "Recipe")
    return [s for s in specs if command != "eval" or s.in_eval]


def linked_options(recipe: ModuleType) -> dict[str, OptionSpec]:
    """{engine field: the recipe option that is its user-facing name}."""
    return {s.engine: s for s in recipe_specs(recipe) if s.engine}


def engine_specs_for(recipe: ModuleType, command: Command = "train") -> list[OptionSpec]:
    """The engine options that are flags of `command`: all but those a recipe option names, and for
    `eval` only the options eval reads (declared `in_eval=True` next to the field)."""
    linked = linked_options(recipe)
    return [s for s in option_specs() if s.name not in linked and (command != "eval" or s.in_eval)]


def flag_hints(recipe: ModuleType, command: Command) -> dict[str, str]:
    """Why an engine flag that exists is not a flag of this command: the error says so instead of 'no such option'."""
    hints = {}
    for name, r in linked_options(recipe).items():
        e = next(s for s in option_specs() if s.name == name)
        if e.flag != r.flag:
            for flag in (e.flag, "--no-" + e.flag[2:]) if e.kind in ("bool", "tristate") else (e.flag,):
                hints[flag] = f"the recipe option {r.flag} sets this engine option; give {r.flag} instead."
    if command == "eval":
        linked = linked_options(recipe)
        training_only = [s for s in option_specs() if not s.in_eval and s.name not in linked]
        for r in recipe_specs(recipe):
            if not r.in_eval:  # the recipe option, and the engine option it names
                training_only += [r] + [e for e in option_specs() if e.name in linked and linked[e.name].name == r.name]
        for s in training_only:
            for flag in (s.flag, "--no-" + s.flag[2:]) if s.kind in ("bool", "tristate") else (s.flag,):
                hints[flag] = "not an option of `miles eval` (only training reads it)."
    return hints


@dataclasses.dataclass
class Invocation:
    """Everything a run needs, resolved: recipe options, its plan, the engine config and value sources."""

    command: Command
    recipe: ModuleType
    options: RecipeOptions
    plan: RecipePlan
    config: EngineConfig
    sources: dict[str, str]
    recipe_sources: dict[str, str] = dataclasses.field(default_factory=dict)
    env: dict[str, str] = dataclasses.field(default_factory=dict)
    recipe_rules: dict[str, str] = dataclasses.field(default_factory=dict)
    """{engine field: the rule's text} of the recipe's derived values this invocation used (`RecipePlan.derived`)."""

    def differs_from_recipe(self) -> dict[str, str]:
        """{flag: source} of every option the user set (anything not from the recipe or a default)."""
        out = {}
        for name, source in self.recipe_sources.items():
            # --extra-args itself is not listed: the values it set are, with their source.
            if source not in ("recipe default", "derived") and name != "extra_args":
                out["--" + name.replace("_", "-")] = source
        for name, source in self.sources.items():
            if source in ("command line", "--extra-args", "after --", "api") or source.startswith("env "):
                out[next(s.flag for s in option_specs() if s.name == name)] = source
        return out


def in_user_terms(error: UserError, recipe: ModuleType) -> UserError:
    """The same error, naming the recipe option where the engine's checks name an engine option that
    has no flag of its own (`--actor-num-nodes` → `--num-nodes`). Options whose values differ
    (`--hardware` picks `device`) keep the engine's name: the sentence's values are the engine's."""
    message, option = str(error), error.option
    for name, r in linked_options(recipe).items():
        e = next(s for s in option_specs() if s.name == name)
        if e.flag != r.flag and r.field.metadata.get("to_engine") is None:
            message = message.replace(e.flag, r.flag)
            option = r.flag if option == e.flag else option
    if message == str(error):
        return error
    return UserError(message, option=option)


def _parse_layer(parser: Any, tokens: list[str], where: str, command: Command, recipe: ModuleType) -> dict[str, Any]:
    """Engine values in `tokens`, parsed by the command's own parser (the one the command line uses)."""
    if not tokens:
        return {}
    import typer
    from typer._click.exceptions import ClickException

    parser = parser or _parser(command, recipe.NAME)

    from miles_cli.help import user_error_from_click

    try:
        ctx = parser.make_context(f"miles {command}", list(tokens))
    except typer.Exit:
        raise UserError(f"{where} cannot show help; run `miles {command} --help`.", option=where) from None
    except ClickException as e:
        raise user_error_from_click(e, where=where, hints=flag_hints(recipe, command)) from None
    if ctx.args:
        raise UserError(f"Unexpected value {ctx.args[0]!r} in {where}; every value must follow its --flag.", option=where)
    engine = {s.name for s in engine_specs_for(recipe, command)}
    values: dict[str, Any] = {}
    for param in parser.params:
        source = ctx.get_parameter_source(param.name)
        if source is None or source.name != "COMMANDLINE":
            continue
        flag = max(param.opts, key=len)
        if param.name not in engine:
            raise UserError(f"{flag} is an option of the command, not an engine option; give it on the command line, not in {where}.", option=flag)
        value = ctx.params[param.name]
        values[param.name] = list(value) if isinstance(value, tuple) else value
    return values


@functools.cache
def _parser(command: Command, recipe_name: str) -> Any:
    """The Click command of `miles <command> --model-name <recipe>` (declared defaults), for the API and
    for the layers a command line carries (--extra-args, after --); it reads values, never shows them."""
    import typer

    from miles_cli.run_commands import build_run_command

    app = typer.Typer(add_completion=False)
    from miles_cli.help import MilesCommand

    app.command(command, cls=MilesCommand, context_settings={"allow_extra_args": True})(
        build_run_command(command, get_recipe(recipe_name), parser_only=True)
    )
    from miles_cli import coerce

    return coerce.install(typer.main.get_command(app))


def resolve_invocation(
    command: Command,
    recipe: ModuleType,
    options: RecipeOptions,
    given: dict[str, Any],
    passthrough: list[str],
    *,
    parser: Any = None,
    given_source: str = "command line",
    check: bool = True,
) -> Invocation:
    """Layer the recipe, its linked options, `given` engine values, `--extra-args` and `passthrough`, then resolve.

    With `check=False` only derived defaults are filled (for help, which must show values even for a
    combination the run would refuse).
    """
    options.resolve()
    plan = recipe.plan(options)
    linked = linked_options(recipe)
    for name in plan.engine:
        if name in linked:
            raise RuntimeError(f"recipe {recipe.NAME}: plan() sets {name}, which the recipe option {linked[name].flag} sets")
    layers = [
        ("recipe", dict(plan.engine)),
        *[(linked[name].flag, {name: value}) for name, value in options.engine_values().items()],
        (given_source, dict(given)),
        ("--extra-args", _parse_layer(parser, split_args(options.extra_args, where="--extra-args"), "--extra-args", command, recipe)),
        ("after --", _parse_layer(parser, list(passthrough), "the arguments after --", command, recipe)),
    ]
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for source, layer in layers:
        # --num-rollout and --num-epoch are alternatives: the one given in a later layer replaces the other.
        for a, b in (("num_epoch", "num_rollout"), ("num_rollout", "num_epoch")):
            if layer.get(a) is not None and b not in layer:
                values.pop(b, None)
                sources.pop(b, None)
        values.update(layer)
        sources.update({k: source for k in layer})
    if sources.get("hf_checkpoint", "recipe") != "recipe":
        _hub_checkpoint(values, options, plan)
    cfg = build_config(values)
    recipe_rules = {}
    for name, rule in plan.derived.items():
        if sources.get(name, "recipe") == "recipe":  # a later layer's value wins over the recipe's rule
            cfg.set(name, rule.rule(cfg))
            sources[name], recipe_rules[name] = "recipe", rule.text
    cfg.run = RunContext(run_id=options.run_id, run_dir=options.run_dir)
    unset_derived = {s.name for s in option_specs() if s.derived is not None and cfg.get(s.name) is None}
    if check:
        try:
            resolve_config(cfg, purpose="eval" if command == "eval" else "train")
        except UserError as e:
            raise in_user_terms(e, recipe) from None
    else:
        fill_derived(cfg)
    for s in option_specs():
        if s.name not in sources:
            sources[s.name] = "derived" if s.name in unset_derived else ("env " + s.env if s.env and cfg.get(s.name) != s.default else "default")
    return Invocation(command, recipe, options, plan, cfg, sources, env={**plan.env, **run_environment(cfg)}, recipe_rules=recipe_rules)


def _hub_checkpoint(values: dict[str, Any], options: RecipeOptions, plan: RecipePlan) -> None:
    """--hf-checkpoint owner/name (a Hub id, not a directory): the run reads <--model-dir>/owner--name,
    which a prepare step of `miles full-train` downloads (skipped once its sentinel is there)."""
    from miles.prepare.hub import hub_checkpoint_dir, sentinel
    from recipes.base import PrepareStep

    repo_id = values.get("hf_checkpoint")
    local_dir = hub_checkpoint_dir(repo_id, options.model_dir)
    if local_dir is None:
        return
    values["hf_checkpoint"] = local_dir
    plan.prepare.insert(
        0, PrepareStep("download-hf-checkpoint", "miles.prepare.hub:download", {"repo_id": repo_id, "local_dir": local_dir},
                       sentinel(local_dir), f"download {repo_id} from the Hugging Face Hub into {local_dir}"),
    )  # fmt: skip


def recipe_values_from_env(recipe: ModuleType, given: dict[str, Any], environ: Any = None) -> dict[str, Any]:
    """`given` plus the recipe options set by MILES_SCRIPT_<FIELD> (the ones not given)."""
    environ = os.environ if environ is None else environ
    out = dict(given)
    for s in recipe_specs(recipe):
        var = ENV_PREFIX + s.name.upper()
        if s.name not in out and environ.get(var):
            out[s.name] = parse_scalar(s, environ[var], source=f"${var}")
    return out


def _unknown(name: str, known: Iterable[str]) -> UserError:
    close = difflib.get_close_matches(name, list(known), n=3, cutoff=0.6)
    hint = f" Did you mean {' or '.join(close)}?" if close else ""
    return UserError(f"{name!r} is not an option of this command.{hint}", option=name)


def resolve(
    recipe: str | None = None,
    command: Command = "train",
    *,
    extra_args: str | None = None,
    args: Iterable[str] = (),
    environ: dict[str, str] | None = None,
    **overrides: Any,
) -> Invocation:
    """The resolved run `miles <command> --model-name <recipe> ...` would start; nothing runs.

    `recipe`: a recipe name (default: $MILES_SCRIPT_MODEL_NAME, else the default recipe).
    `overrides`: recipe and engine options by field name. `extra_args`, `args`: as `--extra-args` and
    the arguments after `--`. Raises `miles.errors.UserError` with the CLI's message on a mistake.
    """
    environ = os.environ if environ is None else environ
    if command not in COMMANDS:
        raise UserError(f"command {command!r} is not one of {', '.join(COMMANDS)}.", option="command")
    module = get_recipe(recipe or environ.get(ENV_PREFIX + "MODEL_NAME") or DEFAULT_RECIPE)
    r_specs = {s.name: s for s in recipe_specs(module, command)}
    e_specs = {s.name: s for s in engine_specs_for(module, command)}
    recipe_values = recipe_values_from_env(module, {"model_name": module.NAME}, environ)
    recipe_sources = {name: "env MILES_SCRIPT_*" for name in recipe_values if name != "model_name"}
    if extra_args is not None:
        overrides["extra_args"] = extra_args
    engine_values: dict[str, Any] = {}
    for name, value in overrides.items():
        s = r_specs.get(name) or e_specs.get(name)
        if s is None:
            if command == "eval" and name in {r.name for r in recipe_specs(module)}:
                raise UserError(f"{name!r} is not an option of eval (only training reads it).", option=name)
            if name in linked_options(module):
                raise UserError(f"{name!r} is set by the recipe option {linked_options(module)[name].name!r}; pass that instead.", option=name)
            raise _unknown(name, list(r_specs) + list(e_specs))
        if s.choices is not None and value is not None and value not in s.choices:
            raise UserError(f"{name}={value!r} is not one of {', '.join(map(str, s.choices))}.", option=s.flag)
        if name in r_specs:
            recipe_values[name] = value
            recipe_sources[name] = "api"
        else:
            engine_values[name] = list(value) if isinstance(value, tuple) else value
    options = module.Options(**recipe_values)
    for s in r_specs.values():
        recipe_sources.setdefault(s.name, "derived" if s.derived is not None else "recipe default")
    inv = resolve_invocation(command, module, options, engine_values, list(args), given_source="api")
    inv.recipe_sources = recipe_sources
    return inv


def run(recipe: str | None = None, command: Command = "train", *, checkpoint: str | None = None, **overrides: Any):
    """Resolve as `resolve()` does, then run it exactly as the CLI would (prepare steps for
    full-train, then training or eval). Returns the training `RunResult` (None for eval)."""
    inv = resolve(recipe, command, **overrides)
    from miles_cli.execute import execute

    try:
        return execute(inv, checkpoint=checkpoint)
    except UserError as e:
        raise in_user_terms(e, inv.recipe) from None
