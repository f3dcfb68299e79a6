"""How `miles` reads arguments and shows help: one parser, one error style, help that fits the terminal.

- **One parser.** `MilesCommand.parse_args` is used for the command line and, by the run commands,
  for `--extra-args "..."` and the arguments after `--` (miles_cli/api.py). Before parsing, a list
  option followed by several values (`--eval-prompt-data arith eval.jsonl`, upstream's form) is
  spelled out as one flag per value, so the same text means the same thing in all three places.
- **One error style.** Every usage mistake, whether Click's (unknown flag, bad value, missing
  option) or a `UserError`, leaves as `Error: <one sentence naming the option>` on stderr with exit
  code 2 (`MilesGroup.main`). Internal errors keep their traceback.
- **Readable help.** Options are rendered from their `FlagDoc` (miles_cli/options.py) with Click's
  plain formatter: a flag too long for the first column gets its own line, text wraps, nothing is
  ever cut. `--help` shows the panels most runs touch; `--help-all` every option, `--help-group
  NAME` one panel. A panel whose options are all unavailable in this build is one line.

    COLUMNS=80 miles train --help
    miles train --help-all
    miles train --help-group rollout
"""

from __future__ import annotations

import bisect
import dataclasses
import difflib
import functools
import itertools
import re
import sys
import textwrap
from typing import Any, Callable, Iterable

import inspect

import typer
import typer.core
from typer import _click as click  # typer vendors its own click; the real one's classes do not mix with it
from typer._click.exceptions import BadParameter, ClickException, MissingParameter, NoSuchOption

from miles.errors import UserError
from miles_cli.lazy import LazyCommands, Pending

# miles_cli.options/params (the engine's declarations) and recipes are imported where a command's
# help or parser needs them, not here: `miles --help` imports this module and only lists commands.
BRIEF_PANELS = ("Recipe", "Run", "Data", "Optimizer", "Checkpoint")  # "Run" is miles_cli.options.RUN_PANEL
"""The panels `miles train --help` shows, whatever the recipe; the others are listed by name with their
option count (SGLang's ~500 pass-through options among them: `--help-group sglang`)."""


@functools.cache
def _stderr() -> Any:
    # rich's console costs as much to import as typer itself; help never needs it, errors do.
    from rich.console import Console

    return Console(stderr=True, highlight=False, soft_wrap=True)


def print_error(message: str) -> None:
    from rich.markup import escape

    _stderr().print(f"[bold red]Error:[/bold red] {escape(message)}")


def panel_slug(panel: str) -> str:
    return panel.lower().replace(" ", "-")


def panel_family(panel: str) -> str:
    """The group name several panels share: the first word of the slug (`sglang` for "SGLang launch",
    "SGLang server" and "SGLang router"), so `--help-group sglang` shows all three."""
    return panel_slug(panel).split("-")[0]


def group_choices(panels: Iterable[str]) -> tuple[str, ...]:
    """`--help-group`'s values: every panel's slug, then every family of two or more panels."""
    panels = list(dict.fromkeys(panels))
    slugs = [panel_slug(p) for p in panels]
    families = [f for f in dict.fromkeys(map(panel_family, panels)) if f not in slugs and sum(panel_family(p) == f for p in panels) > 1]
    return (*slugs, *families)


def in_group(panel: str, group: str) -> bool:
    """Whether `--help-group group` shows `panel`: its slug, or its family."""
    return group in (panel_slug(panel), panel_family(panel))


def expand_list_values(tokens: list[str], list_flags: Iterable[str]) -> list[str]:
    """`--x a b --y` → `--x a --x b --y` for list options (up to `--`); other tokens are unchanged."""
    list_flags = set(list_flags)
    out: list[str] = []
    current, expect_value = None, False
    for i, token in enumerate(tokens):
        if token == "--":
            return out + tokens[i:]
        if token.startswith("--"):
            name, eq, _ = token.partition("=")
            current = name if name in list_flags else None
            expect_value = current is not None and not eq
            out.append(token)
        elif current is not None and not expect_value:
            out += [current, token]
        else:
            out.append(token)
            expect_value = False
    return out


def _docs_of(command: click.Command) -> dict[str, Any]:
    from miles_cli.params import PARAMETER_DOCS

    return getattr(command.callback, PARAMETER_DOCS, {}) or {}


def _plain_help_option(option: Any) -> Any:
    """Click makes `--help` when asked; coerce it without pydantic like every other option (coerce.py)."""
    if option is not None:
        from miles_cli.coerce import install_params

        install_params([option])
    return option


class MilesCommand(typer.core.TyperCommand):
    """A command whose help is rendered from the option declarations and never truncated."""

    def get_help_option(self, ctx: click.Context) -> Any:
        return _plain_help_option(super().get_help_option(ctx))

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        list_flags = [o for p in self.params if getattr(p, "multiple", False) for o in p.opts]
        return super().parse_args(ctx, expand_list_values(list(args), list_flags))

    def format_help(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        # Click's plain layout (typer's rich panels cut long flag names in narrow terminals).
        click.core.Command.format_help(self, ctx, formatter)

    def collect_usage_pieces(self, ctx: click.Context) -> list[str]:
        pieces = super().collect_usage_pieces(ctx)
        if self.allow_extra_args:
            pieces.append("[-- ENGINE-FLAGS...]")
        return pieces

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        docs = _docs_of(self)
        entries = [docs.get(p.name or "") or p.get_help_record(ctx) for p in self.get_params(ctx)]
        # Only commands that offer --help-all have a short help; the others show every option.
        short = any(p.name == "help_all" for p in self.params)
        write_options(ctx, formatter, entries, short_help=short)


def write_options(ctx: click.Context, formatter: click.HelpFormatter, entries: Iterable[Any], *, short_help: bool) -> None:
    """The options part of a command's help, panel by panel. `entries`: in order, each option's FlagDoc
    (or a `Counted` where its panel is not shown), or the (flag, text) record of an option that has
    none (Click's `--help`), or None (an option that is never shown).
    `ctx.meta["miles_help_group"]`: "all" (--help-all), a panel slug (--help-group), or unset (--help:
    with `short_help`, the BRIEF_PANELS; the others are counted, not rendered)."""
    from recipes.base import ENV_PREFIX

    group = ctx.meta.get("miles_help_group")
    panels: dict[str, list[Any]] = {}
    for entry in entries:
        if entry is not None:
            panels.setdefault("Help" if isinstance(entry, tuple) else entry.panel, []).append(entry)
    shown = panel_shown(group, short_help)
    hidden: dict[str, int] = {}  # group name → options not shown; a family of panels is one name
    families = set(group_choices(panels)) - {panel_slug(p) for p in panels}
    for panel, items in panels.items():
        if not shown(panel):
            name = panel_family(panel) if panel_family(panel) in families else panel_slug(panel)
            hidden[name] = hidden.get(name, 0) + len(items)
            continue
        fds = [e for e in items if not isinstance(e, tuple)]
        collapse = group is None or group == "all"  # asked for by name: every option in full
        if collapse and fds and all(fd.unsupported for fd in fds) and len({fd.unsupported for fd in fds}) == 1:
            with formatter.section(panel):
                write_text(
                    formatter,
                    f"Not available in this build ({fds[0].unsupported}): " + ", ".join(fd.flag for fd in fds)
                    + f". Details: `{ctx.command_path} --help-group {panel_slug(panel)}`.",
                )
            continue
        with formatter.section(panel):
            if panel == "Recipe":
                write_text(formatter, f"Each can also be set with {ENV_PREFIX}<NAME> (e.g. {ENV_PREFIX}MODE); the command line wins.")
            write_rows(formatter, [e if isinstance(e, tuple) else _row(e, ENV_PREFIX) for e in items])
    if hidden:
        name = ctx.command_path
        with formatter.section("More options"):
            write_text(
                formatter,
                f"Groups not shown: {', '.join(f'{g} ({n})' for g, n in hidden.items())}. Every option: `{name} --help-all`; "
                f"one group: `{name} --help-group GROUP` (e.g. `--help-group {max(hidden, key=hidden.__getitem__)}`).",
            )


def panel_shown(group: str | None, short_help: bool) -> Callable[[str], bool]:
    """Whether help renders a panel's options (the others it only counts). `group`: see write_options."""
    brief = {"Help", *BRIEF_PANELS}

    def shown(panel: str) -> bool:
        if panel == "Help" or group == "all":
            return True
        if group is None:
            return panel in brief or not short_help
        return in_group(panel, group)

    return shown


class Counted:
    """An option that help counts but does not show (a panel not asked for): no FlagDoc is made for it."""

    __slots__ = ("panel",)

    def __init__(self, panel: str) -> None:
        self.panel = panel


def _row(fd: Any, env_prefix: str) -> tuple[str, str]:
    """(flag column, text column) of one option."""
    from miles_cli.options import help_line, metavar

    first = " / ".join(fd.flags)
    mv = metavar(fd)
    if fd.env and fd.env.startswith(env_prefix):  # said once for the Recipe panel instead
        fd = dataclasses.replace(fd, env=None)
    return f"{first} {mv}".strip(), help_line(fd)


def _show_help(fixed: str | None):
    def callback(ctx: typer.Context, value: Any) -> None:
        if not value or ctx.resilient_parsing:
            return
        ctx.meta["miles_help_group"] = fixed or value
        typer.echo(ctx.get_help())
        raise typer.Exit()

    return callback


def help_docs(panels: list[str]) -> list[FlagDoc]:
    """The FlagDocs of `--help-all` and `--help-group GROUP` for a command with these option panels."""
    from miles.docs.flag import FlagDoc

    slugs = group_choices(panels)
    families = [g for g in slugs if g not in {panel_slug(p) for p in panels}]
    family = f" `{families[0]}` shows every {families[0]}-* group." if families else ""
    return [
        FlagDoc(("--help-all",), "help_all", "Help", "bool", (), None, False, False, None, None, None, "Show every option and exit."),
        FlagDoc(("--help-group",), "help_group", "Help", "str", slugs, None, None, False, None, None, None,
                "Show the options of one group and exit." + family),
    ]  # fmt: skip


def help_parameters(panels: list[str]) -> list[tuple[inspect.Parameter, FlagDoc]]:
    """`--help-all` and `--help-group GROUP` for a command whose options span several panels."""
    from typing import Annotated, Literal, Optional

    docs = help_docs(panels)
    slugs = docs[1].choices
    all_help, group_help = docs[0].help, docs[1].help
    return [
        (
            inspect.Parameter(
                "help_all", inspect.Parameter.KEYWORD_ONLY, default=False,
                annotation=Annotated[bool, typer.Option("--help-all", is_eager=True, expose_value=False,
                                                        callback=_show_help("all"), help=all_help)],
            ),
            docs[0],
        ),
        (
            inspect.Parameter(
                "help_group", inspect.Parameter.KEYWORD_ONLY, default=None,
                annotation=Annotated[Optional[Literal[tuple(slugs)]], typer.Option(  # type: ignore[valid-type]
                    "--help-group", is_eager=True, expose_value=False, callback=_show_help(None), help=group_help,
                )],
            ),
            docs[1],
        ),
    ]


_SPACES = re.compile(r"( +)")


def wrap_words(text: str, width: int) -> list[str]:
    """`textwrap.wrap(text, width, break_on_hyphens=False, break_long_words=False)`: lines of at most
    `width` characters broken at spaces, a longer word alone on its line, spaces at a break dropped.

    textwrap's general loop cost most of the time of a help that shows SGLang's ~600 options; for
    text whose only whitespace is the space (all of miles' help) this is the same greedy fill without
    its generality, and anything else goes to textwrap (tests/cli/test_fast_help.py compares both).
    """
    if not (text.isascii() and text.isprintable()):
        return textwrap.wrap(text, width, break_on_hyphens=False, break_long_words=False)
    chunks = [c for c in _SPACES.split(text) if c]  # words and runs of spaces, alternating; they make up text
    ends = list(itertools.accumulate(map(len, chunks)))  # where each chunk ends in text
    lines: list[str] = []
    i, n = 0, len(chunks)
    while i < n:
        if lines and chunks[i][0] == " ":  # a line never starts with the spaces it broke at (the first may)
            i += 1
            if i == n:
                break
        start = i
        offset = ends[start - 1] if start else 0
        i = bisect.bisect_right(ends, offset + width, start)  # the chunks that fit, greedily
        if i == start:  # a word longer than the line: alone on it, never cut
            i += 1
        end = i - 1 if chunks[i - 1][0] == " " else i  # nor ends with them
        if end > start:
            lines.append(text[offset : ends[end - 1]])
    return lines


def write_text(formatter: Any, text: str) -> None:
    """A paragraph at the current indent, wrapped at spaces only (flags are never split)."""
    indent = " " * formatter.current_indent
    width = max(formatter.width - formatter.current_indent, 30)
    for line in wrap_words(text, width):
        formatter.write(indent + line + "\n")


def write_rows(formatter: Any, rows: list[tuple[str, str]], col_max: int = 32) -> None:
    """Two columns (flag, help) like Click's `write_dl`, but a word (a path, a default) is never split
    at a hyphen or cut: a word longer than the column stands on its own line."""
    indent = formatter.current_indent
    first_width = min(max(len(first) for first, _ in rows), col_max)
    text_width = max(formatter.width - indent - first_width - 2, 30)
    for first, text in rows:
        lines = wrap_words(text, text_width) or [""]
        if len(first) <= first_width:
            formatter.write(f"{'':{indent}}{first:<{first_width}}  {lines[0]}\n")
            lines = lines[1:]
        else:  # on its own line(s): `--long-flag / --no-long-flag` breaks after the slash, never inside a flag
            for part in wrap_words(first, max(formatter.width - indent, 30)):
                formatter.write(f"{'':{indent}}{part}\n")
        for line in lines:
            formatter.write(f"{'':{indent + first_width + 2}}{line}\n")


class MilesGroup(typer.core.TyperGroup):
    """The `miles` group: plain help, every usage error in the one `Error: ...` style (exit 2), and
    subcommands built only when invoked, completed or documented (miles_cli/lazy.py)."""

    pending: dict[str, Pending] = {}
    """Commands to build on first use, in listing order; `with_pending` makes a group class that has them."""

    @classmethod
    def with_pending(cls, pending: dict[str, Pending]) -> type["MilesGroup"]:
        # Typer takes the group's class, not an instance, so the pending commands travel on a subclass.
        return type(cls.__name__, (cls,), {"pending": dict(pending)})

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        commands = LazyCommands(self.pending)
        commands.update(self.commands)
        self.commands = commands

    def get_help_option(self, ctx: click.Context) -> Any:
        return _plain_help_option(super().get_help_option(ctx))

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        from miles_cli.coerce import install_params

        install_params(self.params)  # Typer appends --install-completion/--show-completion after __init__
        return super().parse_args(ctx, args)

    def list_commands(self, ctx: click.Context) -> list[str]:
        return list(self.commands)  # Typer's reads every value, which would build every command

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        # Typer's listing, from the summaries: listing builds no command.
        commands = [(name, self.commands.summary_of(name)) for name in self.list_commands(ctx)]
        commands = [(name, cmd) for name, cmd in commands if not cmd.hidden]
        if commands:
            limit = formatter.width - 6 - max(len(name) for name, _ in commands)
            with formatter.section("Commands"):
                formatter.write_dl([(name, cmd.get_short_help_str(limit)) for name, cmd in commands])

    def shell_complete(self, ctx: click.Context, incomplete: str) -> list[Any]:
        from typer._click.shell_completion import CompletionItem

        results = [
            CompletionItem(name, help=cmd.get_short_help_str())
            for name in self.list_commands(ctx)
            if name.startswith(incomplete) and not (cmd := self.commands.summary_of(name)).hidden
        ]
        results.extend(click.core.Command.shell_complete(self, ctx, incomplete))
        return results

    def main(self, args: Any = None, prog_name: Any = None, complete_var: Any = None, standalone_mode: bool = True, **extra: Any) -> Any:
        try:
            rv = super().main(args=args, prog_name=prog_name, complete_var=complete_var, standalone_mode=False, **extra)
        except ClickException as e:
            print_error(str(user_error_from_click(e)))
            if standalone_mode:
                sys.exit(2)
            raise
        except UserError as e:
            print_error(str(e))
            if standalone_mode:
                sys.exit(e.exit_code)
            raise
        except typer.Abort:
            _stderr().print("Aborted.")
            if standalone_mode:
                sys.exit(1)
            raise
        if standalone_mode:
            sys.exit(rv if isinstance(rv, int) else 0)
        return rv


def _raw_input(e: Exception) -> Any:
    """The text the user gave, from the validation error typer raised the usage error from."""
    cause = e.__cause__
    errors = cause.errors() if cause is not None and hasattr(cause, "errors") else []
    return errors[0].get("input") if errors else None


def user_error_from_click(e: ClickException, *, where: str | None = None, hints: dict[str, str] | None = None) -> UserError:
    """One sentence naming the option, whatever Click complained about. `hints`: flag → why it is not here."""
    place = f" in {where}" if where else ""
    hints = dict(hints or {})
    ctx = getattr(e, "ctx", None)
    if ctx is not None and ctx.command is not None:
        hints = {**getattr(ctx.command.callback, "__miles_flag_hints__", {}), **hints}
    if isinstance(e, NoSuchOption):
        flag = e.option_name
        from miles.config.sglang import removed_flag_error

        removed = removed_flag_error(flag)
        if removed is not None:  # a flag SGLang removed or upstream's spelling: the one to write instead
            text = str(removed)
            if place:
                i = text.index(removed.option) + len(removed.option)
                text = text[:i] + place + text[i:]
            return UserError(text, option=removed.option)
        if flag in hints:
            return UserError(f"{flag}{place}: {hints[flag]}", option=flag)
        close = difflib.get_close_matches(flag, e.possibilities or [], n=3, cutoff=0.6) if e.possibilities else []
        hint = f" Did you mean {' or '.join(close)}?" if close else " Run the command with --help-all to list the options."
        return UserError(f"No such option {flag}{place}.{hint}", option=flag)
    param = getattr(e, "param", None)
    flag = None
    if param is not None and getattr(param, "opts", None):
        flag = max(param.opts, key=len)
    if isinstance(e, MissingParameter) and flag:
        return UserError(f"{flag} is required{place}; give it a value.", option=flag)
    if isinstance(e, BadParameter) and flag:
        descriptor = getattr(param, "type_descriptor", None)
        if descriptor is not None and descriptor.is_choice:  # name only the choices this build can run
            docs = _docs_of(ctx.command) if ctx is not None else {}
            fd = docs.get(param.name or "")
            choices = fd.choices if fd is not None and fd.choices else tuple(descriptor.choices or ())
            m = re.search(r"('[^']*') is not one of", e.message)
            value = m.group(1) if m else "the value"
            return UserError(f"{flag}{place}: {value} is not one of {', '.join(map(str, choices))}; pick one of those.", option=flag)
        raw = _raw_input(e)
        fd = _docs_of(ctx.command).get(param.name or "") if ctx is not None else None
        base = (fd.type[5:-1] if fd.type.startswith("list[") else fd.type) if fd is not None else ""
        kind = {"int": "an integer", "float": "a number", "bool": "true or false"}.get(base)
        if raw is not None and kind:  # typer's own wording comes from pydantic; say it the miles way
            return UserError(f"{flag}{place}: {raw!r} is not {kind}; give {flag} {kind}.", option=flag)
        return UserError(f"{flag}{place}: {e.message.rstrip('.')}.", option=flag)
    m = re.fullmatch(r"Option '(--[^']+)' does not take a value\.?", e.format_message())
    if m:
        flag = m.group(1)
        return UserError(f"{flag}{place} does not take a value; write {flag} or --no-{flag[2:]}.", option=flag)
    message = e.format_message().rstrip(".")
    return UserError(f"{message}{place}.", option=flag)

