"""`miles full-train`, `miles train` and `miles eval`: a thin command-line layer over `miles_cli.api`.

The options of these commands are generated for the recipe chosen by `--model-name` (read before the
command is built). Before building it, the arguments are parsed once leniently to learn this
invocation's recipe options, engine flags, `--extra-args` and `--` arguments, so `--help` shows the
values this run would really use (`MILES_SCRIPT_MODE=debug_minimal miles train --help` shows
`--num-rollout 3`). Values then go to `miles_cli.api.resolve_invocation`, exactly as a Python
caller's keyword arguments do.

`--dry-run` prints every resolved option and the prepare steps, then stops. A real start prints only
the options that differ from the recipe's defaults, writes the full table to the run directory, and
runs. The heavy work is imported only when it runs.
"""

from __future__ import annotations

import dataclasses
import inspect
import sys
from types import ModuleType
from typing import Any, Callable

import typer

from miles.errors import UserError
from miles_cli.api import (
    Command,
    Invocation,
    engine_specs_for,
    flag_hints,
    in_user_terms,
    recipe_specs,
    recipe_values_from_env,
    resolve_invocation,
)
from miles.config.engine import OptionSpec
from miles.config.values import format_value
from miles.docs.flag import FlagDoc
from miles_cli import summaries
from miles_cli.argv import help_request
from miles_cli.errors import user_errors_exit_2
from miles_cli.help import help_parameters
from miles_cli.options import NO_VALUE, flag_doc, run_control_specs
from miles_cli.params import commandline_values, make_parameter, with_signature
from recipes.base import ENV_PREFIX

SUMMARIES: dict[Command, str] = summaries.RUN  # type: ignore[assignment]
FLAG_HINTS = "__miles_flag_hints__"


def _beyond_help(args: list[str]) -> list[str]:
    """`args` without the help options: when nothing is left, help shows the recipe's own values
    (and MILES_SCRIPT_* ones) and the parse below, which builds a second command, is not needed."""
    out, skip = [], False
    for token in args:
        if skip:
            skip = False
        elif token == "--help-group":
            skip = True
        elif token not in ("--help", "--help-all") and not token.startswith("--help-group="):
            out.append(token)
    return out


def preview_invocation(command: Command, recipe: ModuleType, args: list[str] | None) -> Invocation | None:
    """The invocation `args` describe, resolved without checks (for help); None if it cannot be read."""
    from typer._click.exceptions import ClickException

    from miles_cli.api import _parser

    options_given: dict[str, Any] = {}
    engine_given: dict[str, Any] = {}
    passthrough: list[str] = []
    request = help_request(args or [])
    if request is not None:  # only help, maybe for a recipe: the value Click would read, without a parser
        if request.model_name is not None:
            options_given["model_name"] = request.model_name
    elif _beyond_help(args or []):
        parser = _parser(command, recipe.NAME)
        try:
            ctx = parser.make_context(f"miles {command}", list(args), resilient_parsing=True)
        except ClickException:
            ctx = None
        if ctx is not None:
            r_names = {s.name for s in recipe_specs(recipe, command)}
            e_names = {s.name for s in engine_specs_for(recipe, command)}
            for name, value in ctx.params.items():
                source = ctx.get_parameter_source(name)
                if value is None or source is None or source.name not in ("COMMANDLINE", "ENVIRONMENT"):
                    continue
                value = list(value) if isinstance(value, tuple) else value
                if name in r_names:
                    options_given[name] = value
                elif name in e_names and source.name == "COMMANDLINE":
                    engine_given[name] = value
            passthrough = list(ctx.args)
    for attempt in ((options_given, engine_given, passthrough), (options_given, {}, []), ({}, {}, [])):
        try:
            options = recipe.Options(**recipe_values_from_env(recipe, attempt[0]))
            return resolve_invocation(command, recipe, options, attempt[1], attempt[2], check=False)
        except (UserError, TypeError, ValueError):
            continue
    return None


def _source_label(source: Any, derived: bool) -> str:
    name = getattr(source, "name", "")
    return {"COMMANDLINE": "command line", "ENVIRONMENT": "env MILES_SCRIPT_*"}.get(name, "derived" if derived else "recipe default")


def option_docs(
    command: Command, recipe: ModuleType, preview: Invocation | None, shown: Callable[[str], bool] | None = None
) -> list[tuple[OptionSpec, Any, FlagDoc | None, str | None]]:
    """Every option of `command` in help order: (declaration, the value this invocation uses, the
    FlagDoc help shows for it, its environment variable). `preview`: the invocation, or None when it
    cannot be resolved (help then shows the declared defaults and rules). `shown(panel)`: make FlagDocs
    only for the panels it accepts (None for the others; help only counts those)."""
    out: list[tuple[OptionSpec, Any, FlagDoc | None, str | None]] = []
    if command == "eval":  # what to evaluate comes first: --checkpoint is the option eval is for
        out += [(s, s.default, flag_doc(s, s.default), None) for s in run_control_specs(command)]
    for s in recipe_specs(recipe, command):
        value = getattr(preview.options, s.name) if preview is not None else getattr(recipe.Options(), s.name)
        env = ENV_PREFIX + s.name.upper()
        out.append((s, value, flag_doc(s, value, env=env), env))
    for s in engine_specs_for(recipe, command):
        if shown is not None and not shown(s.panel):
            out.append((s, NO_VALUE, None, None))
        elif preview is None:
            value = NO_VALUE if s.derived is not None else s.default
            out.append((s, value, flag_doc(s, value), None))
        else:
            value = preview.config.get(s.name)
            by_rule = preview.sources.get(s.name) == "derived"
            doc = flag_doc(s, value if (s.derived is None or by_rule or value is not None) else NO_VALUE)
            if s.derived is not None and not by_rule:  # the recipe or the user set it: show the value, not the rule
                doc = _as_plain_default(doc)
            if s.name in preview.recipe_rules:  # the recipe computes it: the value and the recipe's rule
                doc = dataclasses.replace(doc, default=None, derived=preview.recipe_rules[s.name], derived_value=format_value(value))
            out.append((s, value, doc, None))
    if command != "eval":
        out += [(s, s.default, flag_doc(s, s.default), None) for s in run_control_specs(command)]
    return out


def build_run_command(command: Command, recipe: ModuleType, args: list[str] | None = None, *, parser_only: bool = False):
    """A Typer command function for `command` whose options are this recipe's and the engine's,
    each showing the value the invocation `args` (the arguments after the command name) would use.
    `parser_only`: a command only to parse with (its help shows the declared defaults); it resolves
    nothing, which the preview itself needs when MILES_SCRIPT_EXTRA_ARGS must be parsed."""
    r_specs = recipe_specs(recipe, command)
    e_specs = engine_specs_for(recipe, command)
    preview = None if parser_only else preview_invocation(command, recipe, args)
    declared = option_docs(command, recipe, preview)
    params = [make_parameter(s, value, envvar=env, doc=doc) for s, value, doc, env in declared]
    r_names = [s.name for s in r_specs]
    e_names = [s.name for s in e_specs]
    derived_recipe = {s.name for s in r_specs if s.derived is not None}

    def run(ctx, **kwargs: Any) -> None:
        with user_errors_exit_2():
            options = recipe.Options(**{n: kwargs[n] for n in r_names})
            given = commandline_values(ctx, kwargs, e_names)
            passthrough = list(ctx.args)
            if passthrough and "--" not in sys.argv[1:]:
                raise UserError(f"Unexpected argument {passthrough[0]!r}; engine flags go after `--` or in --extra-args.")
            inv = resolve_invocation(command, recipe, options, given, passthrough, parser=ctx.command)
            inv.recipe_sources = {n: _source_label(ctx.get_parameter_source(n), n in derived_recipe) for n in r_names}
            from miles_cli.output import print_changed_options, print_options_table, print_plan

            if kwargs["dry_run"]:
                from miles.run_guard import preflight

                print_options_table(inv)
                print_plan(inv)
                # Every check the run makes before it starts, last, so an error is never buried.
                preflight(inv, kwargs.get("checkpoint"), planning=True)
                if command != "eval":
                    from miles_cli.run_plan import check_memory

                    check_memory(inv)
                return
            print_changed_options(inv)
            from miles_cli.execute import execute

            try:
                execute(inv, checkpoint=kwargs.get("checkpoint"))
            except UserError as e:
                raise in_user_terms(e, recipe) from None

    run.__doc__ = SUMMARIES[command]
    ctx_param = inspect.Parameter("ctx", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=typer.Context)
    panels = list(dict.fromkeys(s.panel for s, _, _, _ in declared))
    func = with_signature(run, [(ctx_param, None), *params, *help_parameters(panels)])
    setattr(func, FLAG_HINTS, flag_hints(recipe, command))
    return func


def _as_plain_default(doc: FlagDoc) -> FlagDoc:
    """A derived option that the recipe or the user set: help shows its value, not the rule's."""
    return dataclasses.replace(doc, derived_value=None, default=doc.derived_value if doc.derived_value is not None else doc.default)
