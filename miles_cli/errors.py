"""How user errors leave the program: `Error: <one sentence>` on stderr and exit code 2, no traceback."""

from __future__ import annotations

import contextlib
from typing import Iterator

import typer
from rich.console import Console
from rich.markup import escape

from miles.errors import UserError

_stderr = Console(stderr=True)


@contextlib.contextmanager
def user_errors_exit_2() -> Iterator[None]:
    """Turn a `UserError` raised inside a command into the one-line message and exit code 2."""
    try:
        yield
    except UserError as e:
        _stderr.print(f"[bold red]Error:[/bold red] {escape(str(e))}", highlight=False, soft_wrap=True)
        raise typer.Exit(e.exit_code) from None
