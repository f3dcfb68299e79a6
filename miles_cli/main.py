"""The `miles` program: one Typer app with convert, full-train, train, eval and docker-build.

    miles --help
    miles full-train                         # the embedded default: tiny-qwen3 on a CPU
    miles train --model-name tiny-qwen3 --help

`--model-name` (or MILES_SCRIPT_MODEL_NAME) is read before the app is built, so the options and
defaults shown by `--help` are those of that recipe, and the run command being invoked is built for
the rest of the arguments too (help shows this invocation's values). Usage errors of every kind
leave as one `Error: ...` line with exit code 2 (miles_cli/help.py). Shell completion:
`miles --install-completion`. Importing this module, and `miles --help`, must not import torch, ray
or transformers: commands import their heavy work when they run.
"""

from __future__ import annotations

import os
import sys

import typer

from miles.config.sglang import check_removed_flags
from miles.errors import UserError
from miles_cli.convert import SUMMARY as CONVERT_SUMMARY
from miles_cli.convert import build_convert_command
from miles_cli.docker_build import build_docker_build_command
from miles_cli.docs_cmd import docs_app
from miles_cli.help import MilesCommand, MilesGroup, print_error
from miles_cli.run_commands import SUMMARIES, build_run_command
from recipes import DEFAULT_RECIPE, get_recipe
from recipes.base import ENV_PREFIX

APP_HELP = (
    "Miles: reinforcement-learning post-training for large language models. "
    "Run `miles full-train` for the embedded tiny recipe on a CPU; add `--model-name NAME --help` to see a recipe's options."
)


def recipe_name_from(argv: list[str]) -> str:
    """The value of --model-name in argv (last wins), else MILES_SCRIPT_MODEL_NAME, else the default recipe."""
    name = None
    for i, token in enumerate(argv):
        if token == "--":
            break
        if token == "--model-name" and i + 1 < len(argv):
            name = argv[i + 1]
        elif token.startswith("--model-name="):
            name = token.split("=", 1)[1]
    return name or os.environ.get(ENV_PREFIX + "MODEL_NAME") or DEFAULT_RECIPE


def _command_args(argv: list[str], command: str) -> list[str] | None:
    """The arguments after `command` in argv, or None when argv does not invoke it."""
    for i, token in enumerate(argv):
        if token == command:
            return argv[i + 1 :]
        if not token.startswith("-") or token == "--":
            return None
    return None


def build_app(argv: list[str]) -> typer.Typer:
    recipe = get_recipe(recipe_name_from(argv))
    app = typer.Typer(
        name="miles",
        help=APP_HELP,
        cls=MilesGroup,
        no_args_is_help=True,
        add_completion=True,
        rich_markup_mode=None,
        pretty_exceptions_show_locals=False,
        context_settings={"max_content_width": 10_000},  # help uses the terminal's width (COLUMNS)
    )
    run_settings = {"allow_extra_args": True, "ignore_unknown_options": False}
    app.command("convert", cls=MilesCommand, help=CONVERT_SUMMARY, short_help=CONVERT_SUMMARY)(build_convert_command())
    for command in ("full-train", "train", "eval"):
        app.command(command, cls=MilesCommand, help=SUMMARIES[command], short_help=SUMMARIES[command], context_settings=run_settings)(
            build_run_command(command, recipe, _command_args(argv, command))
        )
    app.command(
        "docker-build",
        cls=MilesCommand,
        help="Build (or --dry-run print) the Docker image of one hardware variant.",
        short_help="Build the Docker image of one hardware variant (cu13, cu12-x86, rocm700-mi35x, ...).",
    )(build_docker_build_command())
    app.add_typer(docs_app, name="docs")
    return app


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    try:
        check_removed_flags(argv)
        app = build_app(argv)
    except UserError as e:
        print_error(str(e))
        raise SystemExit(2) from None
    app(args=argv, prog_name="miles")


if __name__ == "__main__":
    main()
