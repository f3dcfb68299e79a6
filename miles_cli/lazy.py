"""Subcommands of `miles` that are built when first needed, so `miles --help` builds none of them.

Building a run command means resolving its recipe's configuration and turning about 150 option
declarations into Click parameters; `miles --help` needs only each command's name and one-line
summary (miles_cli/summaries.py). `LazyCommands` is the group's `commands` mapping: a command
registered with a builder is built on first access (`get`, `[name]`, `items()`, `values()`), which
is what invoking, completing or documenting it does; `summary_of` answers the listing without
building. Names keep their registration order, which is the order help lists them in.

    python -X importtime -m miles_cli.main --help     # no miles.config.engine, recipes or docker tables
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

from typer import _click as click


class Pending(NamedTuple):
    """A command not built yet: its summary for listings, and how to build it; a hidden one (a
    maintainer's command) works when named but is left out of `miles --help` and completion."""

    summary: str
    build: Callable[[], click.Command]
    hidden: bool = False


class LazyCommands(dict):
    """{name: command}; a `Pending` value is replaced by the command it builds when first read."""

    def __getitem__(self, name: str) -> click.Command:
        value = super().__getitem__(name)
        if isinstance(value, Pending):
            hidden, value = value.hidden, value.build()
            value.name = name
            value.hidden = value.hidden or hidden
            super().__setitem__(name, value)
        return value

    def get(self, name: str, default: Any = None) -> Any:
        return self[name] if name in self else default

    def values(self) -> list[click.Command]:  # type: ignore[override]
        return [self[name] for name in self]

    def items(self) -> list[tuple[str, click.Command]]:  # type: ignore[override]
        return [(name, self[name]) for name in self]

    def summary_of(self, name: str) -> click.Command:
        """The command if built, else a stand-in carrying only its name and summary (for listings)."""
        value = super().__getitem__(name)
        if isinstance(value, Pending):
            from typer.core import TyperCommand

            return TyperCommand(name=name, short_help=value.summary, help=value.summary, hidden=value.hidden)
        return value


def typer_command(name: str, func: Callable[..., Any], **info: Any) -> click.Command:
    """The Click command Typer would make of `func` registered on the `miles` app as `name`."""
    import typer
    import typer.main

    from miles_cli import coerce

    app = typer.Typer(rich_markup_mode=None, pretty_exceptions_show_locals=False)
    app.command(name, **info)(func)
    command = typer.main.get_command_from_info(app.registered_commands[0], pretty_exceptions_short=app.pretty_exceptions_short, rich_markup_mode=None)
    return coerce.install(command)


def typer_group(name: str, sub_app: Any) -> click.Command:
    """The Click group Typer would make of `sub_app` added to the `miles` app as `name`."""
    import typer.main
    from typer.models import TyperInfo

    from miles_cli import coerce

    group = typer.main.get_group_from_info(
        TyperInfo(sub_app, name=name), pretty_exceptions_short=True, suggest_commands=True, rich_markup_mode=None
    )
    return coerce.install(group)
