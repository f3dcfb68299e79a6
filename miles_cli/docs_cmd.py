"""`miles docs generate` and `miles docs check`: the generated reference pages and the prose checks.

    miles docs generate          # rewrite docs/reference/*.md and every generated block in docs/*.md
    miles docs check             # check every page; exit 1 listing file:line: problem
    miles docs check --docs-dir my-docs

This module is the CLI side of `miles.docs`: it turns the real Typer app into the plain
`miles.docs.model.CliModel` (the `FlagDoc`s each command was generated from, which `--help` renders
too, once per recipe), and
runs commands in-process for the code-block checks. Generators and checkers live in `miles/docs/`.
Importing it is light (typer only); the work is imported when a command runs.
"""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path
from typing import Any, Iterator

import typer

from miles.config.docs_options import DocsCheckOptions, DocsGenerateOptions
from miles.errors import UserError
from miles_cli import summaries
from miles_cli.params import PARAMETER_DOCS

SUMMARY = summaries.DOCS
# Commands whose real run starts work (training, a build): the docs checks append --dry-run to them.
STARTS_WORK = {"full-train", "train", "eval", "docker-build"}


def repo_root() -> Path:
    """The checkout this miles was installed from (docs are not part of a wheel)."""
    return Path(__file__).resolve().parents[1]


@contextlib.contextmanager
def _environ(env: dict[str, str]) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _click_group(argv: list[str]):
    from miles_cli.main import build_app

    return typer.main.get_command(build_app(argv))


def _plain_flag_doc(param: Any):
    """A FlagDoc for an option declared directly on a Typer function (the docs commands' own options)."""
    from miles.docs.model import FlagDoc

    default = param.default
    return FlagDoc(
        flags=tuple(param.opts) + tuple(param.secondary_opts),
        name=param.name,
        panel="Options",
        type="bool" if param.is_flag else "path",
        choices=(),
        default=None if default is None else str(default),
        default_value=default,
        required=bool(param.required),
        derived=None,
        env=None,
        unsupported=None,
        help=(param.help or "").strip(),
    )


def _commands(group: Any, prefix: str = "") -> list[tuple[str, Any]]:
    out = []
    for name, cmd in group.commands.items():
        full = f"{prefix}{name}"
        if hasattr(cmd, "commands"):
            out.extend(_commands(cmd, full + " "))
        else:
            out.append((full, cmd))
    return out


def command_docs(group: Any) -> dict[str, Any]:
    from miles.docs.model import CommandDoc

    docs = {}
    for name, cmd in _commands(group):
        declared = getattr(cmd.callback, PARAMETER_DOCS, {}) or {}
        flags = tuple(
            declared[p.name] if p.name in declared else _plain_flag_doc(p)
            for p in cmd.params
            if p.name != "help" and (p.expose_value or p.name in declared)
        )
        docs[name] = CommandDoc(
            name=name,
            summary=(cmd.short_help or cmd.help or "").strip(),
            flags=flags,
            has_dry_run=any("--dry-run" in f.flags for f in flags),
            starts_work=name in STARTS_WORK,
        )
    return docs


def invoke(argv: list[str], env: dict[str, str]) -> tuple[int, str]:
    """Run `miles argv` in-process (as the shell would, with `env` added); (exit code, output)."""
    from typer.testing import CliRunner

    from miles.errors import UserError
    from miles_cli.main import build_app

    from miles.errors import MissingInput
    from miles.hardware import MissingHardware
    from miles_cli import errors

    errors.last_error = None
    saved_argv = sys.argv
    # The run commands read sys.argv to tell `--` passthrough from stray arguments: make it the real one.
    sys.argv = ["miles", *argv]
    try:
        with _environ({"COLUMNS": "200", "NO_COLOR": "1", **env}):
            try:
                app = build_app(argv)
            except UserError as e:
                return 2, f"Error: {e}"
            result = CliRunner().invoke(app, argv, catch_exceptions=True)
    finally:
        sys.argv = saved_argv
    output = result.output
    if isinstance(errors.last_error, (MissingInput, MissingHardware)):
        # Configured correctly; only its input files or GPUs are not on this machine (docs are checked anywhere).
        return 0, output
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        output += f"\n{type(result.exception).__name__}: {result.exception}"
    return result.exit_code, output


def parse_only(argv: list[str], env: dict[str, str]) -> str | None:
    """Parse `miles argv` without running it; the parser's error message, or None when it parses."""
    from typer._click.exceptions import ClickException

    from miles.errors import UserError

    with _environ(env):
        try:
            cmd = _click_group(argv)
        except UserError as e:
            return str(e)
        rest, name = list(argv), "miles"
        while hasattr(cmd, "commands"):  # walk down to the (sub)command
            if not rest or rest[0] in ("--help", "--install-completion", "--show-completion"):
                return None
            name = rest.pop(0)
            if name not in cmd.commands:
                return f"No such command {name!r}."
            cmd = cmd.commands[name]
        if "--help" in rest:
            return None
        try:
            with cmd.make_context(name, rest):
                pass
        except typer.Exit:
            return None
        except ClickException as e:
            return e.format_message()
    return None


def cli_model():
    """The CLI as plain data: commands under the default recipe, flags under every recipe, recipes."""
    import dataclasses

    from miles.config.engine import GROUPS, option_specs
    from miles.config.values import format_value
    from miles.docs.model import CliModel, RecipeDoc
    from miles_cli.main import APP_HELP
    from miles_cli.api import resolve_invocation
    from recipes import DEFAULT_RECIPE, RECIPES
    from recipes.base import ENV_PREFIX, RecipeOptions

    commands = command_docs(_click_group(["--model-name", DEFAULT_RECIPE]))
    recipe_flags = {}
    recipes = {}
    base = RecipeOptions()
    base_fields = {f.name for f in dataclasses.fields(RecipeOptions)}
    for name, module in RECIPES.items():
        train = command_docs(_click_group(["--model-name", name]))["train"]
        recipe_flags[name] = {f: fd for fd in train.flags for f in fd.flags}
        options = module.Options()
        shown = {fd.flag: (fd.default if fd.default is not None else f"derived: {fd.derived}") for fd in train.flags if fd.panel == "Recipe"}
        changed, extra = {}, []
        for f in dataclasses.fields(options):
            flag = "--" + f.name.replace("_", "-")
            if f.name not in base_fields:
                extra.append(flag)
            elif f.name != "model_name" and getattr(options, f.name) != getattr(base, f.name):
                changed[flag] = (format_value(getattr(base, f.name)), format_value(getattr(options, f.name)))
        inv = resolve_invocation("train", module, module.Options(), {}, [], check=False)
        declared = {s.name: s for s in option_specs()}
        engine = {}
        for field_name in inv.plan.engine:
            s = declared[field_name]
            value = inv.config.get(field_name)
            if value != s.default:
                engine[s.flag] = (format_value(s.default), format_value(value))
        recipes[name] = RecipeDoc(
            name=name,
            summary=module.SUMMARY,
            module=module.__name__,
            options=shown,
            changed_options=changed,
            extra_options=tuple(extra),
            engine_defaults=engine,
            env=dict(inv.env),
        )
    from miles_cli.api import linked_options

    linked = linked_options(RECIPES[DEFAULT_RECIPE])  # engine options a recipe option names: that is their flag
    groups = []
    for attr, cls, panel in GROUPS:
        flags = [linked[s.name].flag if s.name in linked else s.flag for s in option_specs() if s.group == attr]
        groups.append((panel, f"{cls.__module__}.{cls.__name__}", flags))
    return CliModel(
        program="miles",
        summary=APP_HELP,
        commands=commands,
        recipes=recipes,
        default_recipe=DEFAULT_RECIPE,
        recipe_flags=recipe_flags,
        env_prefix=ENV_PREFIX,
        groups=groups,
        declared_defaults={s.flag: format_value(s.default) for s in option_specs()},
        run_env={
            var: (value, linked[s.name].flag if s.name in linked else s.flag)
            for s in option_specs()
            for var, value in s.run_env.items()
        },
        invoke=invoke,
        parse=parse_only,
    )


docs_app = typer.Typer(name="docs", help=SUMMARY, short_help=SUMMARY, no_args_is_help=True, add_completion=False)


def _generate(o: "DocsGenerateOptions") -> None:
    from miles.docs.generate import write_all

    root = Path(o.root) if o.root else repo_root()
    changed = write_all(root, cli_model())
    for path in changed:
        typer.echo(f"updated {path}")
    typer.echo(f"{len(changed)} file(s) updated" if changed else "all generated docs are up to date")


def _check(o: "DocsCheckOptions") -> None:
    from rich.console import Console

    from miles.docs.check import check_all

    root = Path(o.root) if o.root else repo_root()
    docs_dir = Path(o.docs_dir) if o.docs_dir is not None else None
    if docs_dir is not None and not docs_dir.is_dir():
        raise UserError(f"--docs-dir {docs_dir} is not a directory; give the directory of the pages to check.", option="--docs-dir")
    console = Console(stderr=True, highlight=False, soft_wrap=True)
    problems, notes = check_all(root, cli_model(), docs_dir=docs_dir, progress=console)
    for note in notes:
        console.print(f"note: {note}", markup=False)
    for p in problems:
        typer.echo(str(p))
    if problems:
        console.print(f"{len(problems)} problem(s) found", style="bold red")
        raise typer.Exit(1)
    console.print("docs check passed", style="green")


def _command(options_cls: type, run: Any, doc: str):
    """A docs command whose options are generated from `options_cls`'s fields, like docker-build's."""
    from miles.config.engine import specs_of
    from miles_cli.errors import user_errors_exit_2
    from miles_cli.params import make_parameter, with_signature

    params = [make_parameter(s, s.default) for s in specs_of(options_cls, "docs", "Options")]

    def command(**kwargs: Any) -> None:
        with user_errors_exit_2():
            run(options_cls(**kwargs))

    command.__doc__ = doc
    return with_signature(command, params)


docs_app.command("generate", help="Rewrite docs/reference/*.md and the generated blocks of every page from the code.")(
    _command(DocsGenerateOptions, _generate, "Rewrite the generated docs.")
)
docs_app.command("check", help="Check every page against the code; prints file:line: problem and exits 1 on any.")(
    _command(DocsCheckOptions, _check, "Check every page against the code.")
)
