"""`miles full-train|train|eval --help` rendered straight from the option declarations.

A run command has about 770 options (most of them SGLang's). Building the command means turning each
declaration into a Click parameter through Typer's signature machinery: 0.13 s, more than everything
else `miles train --help` did. A help request needs none of it: help is rendered from
each option's `FlagDoc` (miles_cli/options.py), which the built command only carries along. So when a
run command's arguments only ask for help (`--help`, `--help-all` or `--help-group GROUP`, with any
`--model-name NAME`: miles_cli/argv.py), `main` prints it from here. It resolves the invocation with
the same preview (miles_cli/run_commands.py), makes the same FlagDocs (`option_docs`) and renders them
with the same code (miles_cli/help.py `write_options`) under the same Click context settings, so the
bytes are the built command's (tests/cli/test_fast_help.py compares both for every command, several
recipes, `--help-all` and every `--help-group`). Anything else goes to the built command, which also
gives every error (an unknown recipe, a group that does not exist).

    python -X importtime -m miles_cli.main train --help     # neither rich nor miles_cli.coerce: nothing parses
"""

from __future__ import annotations

import os
from typing import Any

from typer import _click as click
from typer.core import TyperCommand

from miles_cli import summaries
from miles_cli.argv import help_request
from miles_cli.help import Counted, MilesCommand, group_choices, help_docs, panel_shown, write_options

class _DeclaredHelp(MilesCommand):
    """A run command that only knows its options' FlagDocs: enough to print its help, not to parse."""

    def __init__(self, name: str, entries: list[Any]) -> None:
        super().__init__(name=name, help=summaries.RUN[name], short_help=summaries.RUN[name])
        self.entries = entries

    def get_help_option(self, ctx: click.Context) -> Any:
        return click.core.Command.get_help_option(self, ctx)  # never parses: no coercion to install

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        # Click's own `--help` (it has no FlagDoc), last, where the built command lists it.
        help_record = self.get_help_option(ctx).get_help_record(ctx)
        write_options(ctx, formatter, [*self.entries, help_record], short_help=True)


def help_text(argv: list[str]) -> str | None:
    """What `miles argv` prints when argv only asks for a run command's help; None otherwise (or when
    the recipe is unknown, which the built command reports)."""
    # Shell completion (`miles --install-completion`): Click answers it before it reads the arguments.
    if not argv or argv[0] not in summaries.RUN or "_MILES_COMPLETE" in os.environ:
        return None
    request = help_request(argv[1:])
    if request is None:
        return None
    from miles.errors import UserError
    from miles_cli.main import GROUP_CONTEXT, recipe_name_from
    from miles_cli.run_commands import option_docs, preview_invocation
    from recipes import get_recipe

    command = argv[0]
    try:
        recipe = get_recipe(recipe_name_from(argv))
    except UserError:
        return None
    preview = preview_invocation(command, recipe, argv[1:])  # type: ignore[arg-type]
    # FlagDocs only for the panels shown: the others are counted (most of SGLang's ~600 options).
    declared = option_docs(command, recipe, preview, panel_shown(request.group, True))  # type: ignore[arg-type]
    entries = [doc if doc is not None else Counted(s.panel) for s, _, doc, _ in declared]
    panels = list(dict.fromkeys(s.panel for s, _, _, _ in declared))
    if request.group not in (None, "all") and request.group not in group_choices(panels):
        return None
    cmd = _DeclaredHelp(command, [*entries, *help_docs(panels)])
    # The contexts the `miles` group and its subcommand would make.
    parent = click.Context(TyperCommand("miles", add_help_option=False), info_name="miles", **GROUP_CONTEXT)
    ctx = click.Context(cmd, info_name=command, parent=parent)
    if request.group is not None:
        ctx.meta["miles_help_group"] = request.group
    return ctx.get_help()
