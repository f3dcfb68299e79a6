"""The `miles` program: one Typer app with convert, full-train, train, eval and docker-build.

    miles --help
    miles full-train                         # the embedded default: tiny-qwen3 on a CPU
    miles train --model-name tiny-qwen3 --help

`--model-name` (or MILES_SCRIPT_MODEL_NAME) is read before the app is built, so the options and
defaults shown by `--help` are those of that recipe. Importing this module, and `miles --help`, must
not import torch, ray or transformers: commands import their heavy work when they run.
"""

from __future__ import annotations

import os
import sys

import typer

from miles.config.sglang import check_removed_flags
from miles.errors import UserError
from miles_cli.convert import SUMMARY as CONVERT_SUMMARY
from miles_cli.convert import build_convert_command
from miles_cli.docker_build import docker_build
from miles_cli.docs_cmd import docs_app
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


def build_app(argv: list[str]) -> typer.Typer:
    recipe = get_recipe(recipe_name_from(argv))
    app = typer.Typer(
        name="miles",
        help=APP_HELP,
        no_args_is_help=True,
        add_completion=False,
        rich_markup_mode="rich",
        pretty_exceptions_show_locals=False,
    )
    run_settings = {"allow_extra_args": True, "ignore_unknown_options": False}
    app.command("convert", help=CONVERT_SUMMARY, short_help=CONVERT_SUMMARY)(build_convert_command())
    for command in ("full-train", "train", "eval"):
        app.command(command, help=SUMMARIES[command], short_help=SUMMARIES[command], context_settings=run_settings)(
            build_run_command(command, recipe, argv)
        )
    app.command(
        "docker-build",
        help="Build (or --dry-run print) the Docker image of one hardware variant.",
        short_help="Build the Docker image of one hardware variant (cu13, cu12-x86, rocm700-mi35x, ...).",
    )(docker_build)
    app.add_typer(docs_app, name="docs")
    return app


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    try:
        check_removed_flags(argv)
        app = build_app(argv)
    except UserError as e:
        typer.echo(f"Error: {e}", err=True)
        raise SystemExit(2) from None
    app(args=argv, prog_name="miles")


if __name__ == "__main__":
    main()
