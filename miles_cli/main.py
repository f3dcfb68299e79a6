"""The `miles` program: one Typer app with convert, full-train, train, eval and docker-build (and
`docs`, the maintainers' command, which works when named but is not listed).

    miles --help
    miles full-train                         # the embedded default: tiny-qwen3 on a CPU
    miles train --model-name tiny-qwen3 --help

Each command is built only when it is invoked, completed or documented (miles_cli/lazy.py):
`miles --help` lists them from miles_cli/summaries.py and imports none of them. A run command is
built for the recipe that `--model-name` (or MILES_SCRIPT_MODEL_NAME) names, and for the rest of
the arguments too, so its `--help` shows this invocation's options, defaults and values (help alone
is printed from the declarations without building the command: miles_cli/fast_help.py). Usage
errors of every kind leave as one `Error: ...` line with exit code 2 (miles_cli/help.py). Shell
completion: `miles --install-completion`. Importing this module, and `miles --help`, must not import
torch, ray or transformers (nor the engine's configuration): commands import their work when they run.
Where the time of `miles --help` goes: `python -X importtime -m miles_cli.main --help`.
"""

from __future__ import annotations

import functools
import os
import sys
from typing import Any

import typer

from miles.errors import UserError
from miles_cli import summaries
from miles_cli.argv import flag_value
from miles_cli.help import MilesCommand, MilesGroup, print_error
from miles_cli.lazy import Pending, typer_command, typer_group

APP_HELP = (
    "Miles: reinforcement-learning post-training for large language models. "
    "Run `miles full-train` for the embedded tiny recipe on a CPU; add `--model-name NAME --help` to see a recipe's options."
)


GROUP_CONTEXT = {"max_content_width": 10_000}
"""The `miles` group's Click context settings (its commands inherit them): help uses the terminal's width (COLUMNS)."""


def recipe_name_from(argv: list[str]) -> str:
    """The value of --model-name in argv (last wins), else MILES_SCRIPT_MODEL_NAME, else the default recipe."""
    from recipes import DEFAULT_RECIPE
    from recipes.base import ENV_PREFIX

    return flag_value(argv, "--model-name") or os.environ.get(ENV_PREFIX + "MODEL_NAME") or DEFAULT_RECIPE


def _command_args(argv: list[str], command: str) -> list[str] | None:
    """The arguments after `command` in argv, or None when argv does not invoke it."""
    for i, token in enumerate(argv):
        if token == command:
            return argv[i + 1 :]
        if not token.startswith("-") or token == "--":
            return None
    return None


def _convert() -> Any:
    from miles_cli.convert import build_convert_command

    return typer_command("convert", build_convert_command(), cls=MilesCommand, help=summaries.CONVERT, short_help=summaries.CONVERT)


def _run(command: str, argv: list[str]) -> Any:
    from miles_cli.run_commands import build_run_command
    from recipes import get_recipe

    recipe = get_recipe(recipe_name_from(argv))
    return typer_command(
        command,
        build_run_command(command, recipe, _command_args(argv, command)),  # type: ignore[arg-type]
        cls=MilesCommand,
        help=summaries.RUN[command],
        short_help=summaries.RUN[command],
        context_settings={"allow_extra_args": True, "ignore_unknown_options": False},
    )


def _docker_build() -> Any:
    from miles_cli.docker_build import build_docker_build_command

    return typer_command(
        "docker-build", build_docker_build_command(), cls=MilesCommand, help=summaries.DOCKER_BUILD, short_help=summaries.DOCKER_BUILD_SHORT
    )


def _docs() -> Any:
    from miles_cli.docs_cmd import docs_app

    return typer_group("docs", docs_app)


def _version(value: bool) -> None:
    if value:
        from importlib.metadata import PackageNotFoundError, version

        try:
            typer.echo(f"miles {version('miles')}")
        except PackageNotFoundError:  # a checkout on PYTHONPATH that was never installed
            typer.echo("miles (not installed: run pip install -e . in the checkout)")
        raise typer.Exit(0)


def _root(
    show_version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version of miles and exit."),
) -> None:
    pass  # the group itself does nothing; a callback lets Typer make a group of no registered commands


def build_app(argv: list[str]) -> typer.Typer:
    """The `miles` app for this argv. Each command is built when first used (miles_cli/lazy.py); a run
    command is built for the recipe `--model-name` names and shows this invocation's values."""
    pending = {
        "convert": Pending(summaries.CONVERT, _convert),
        **{c: Pending(summaries.RUN[c], functools.partial(_run, c, argv)) for c in ("full-train", "train", "eval")},
        "docker-build": Pending(summaries.DOCKER_BUILD_SHORT, _docker_build),
        # A maintainer's command (regenerate and check the docs): runs when named, not on the user's first screen.
        "docs": Pending(summaries.DOCS, _docs, hidden=True),
    }
    return typer.Typer(
        name="miles",
        help=APP_HELP,
        cls=MilesGroup.with_pending(pending),
        callback=_root,
        no_args_is_help=True,
        add_completion=True,
        rich_markup_mode=None,
        pretty_exceptions_show_locals=False,
        context_settings=dict(GROUP_CONTEXT),
    )


def check_removed_flags(argv: list[str]) -> None:
    """SGLang's removed flags and upstream's `--router-*` spellings exit 2 naming the flag to write."""
    # miles.config.sglang builds its dataclasses from the SGLang snapshot: import it only when a
    # token could be one of those flags (every one starts --sglang-/--router-, or their --no- forms).
    if any(t.lstrip("-").removeprefix("no-").startswith(("sglang-", "router-")) for t in argv if t.startswith("--")):
        from miles.config.sglang import check_removed_flags as check

        check(argv)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    try:
        check_removed_flags(argv)
        from miles_cli.fast_help import help_text

        text = help_text(argv)  # a run command's help, from the declarations (no command built)
        if text is not None:
            typer.echo(text)
            raise SystemExit(0)
        app = build_app(argv)
    except UserError as e:
        print_error(str(e))
        raise SystemExit(2) from None
    app(args=argv, prog_name="miles")


if __name__ == "__main__":
    main()
