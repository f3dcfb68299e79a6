"""How user errors leave the program: `Error: <one sentence>` on stderr and exit code 2, no traceback."""

from __future__ import annotations

import contextlib
from typing import Iterator

import typer
from rich.console import Console
from rich.markup import escape

from miles.errors import UserError

_stderr = Console(stderr=True)
last_error: UserError | None = None  # the latest user error reported (read by `miles docs check`, in-process)


@contextlib.contextmanager
def user_errors_exit_2() -> Iterator[None]:
    """Turn a `UserError` raised inside a command into the one-line message and exit code 2."""
    try:
        yield
    except UserError as e:
        global last_error
        last_error = e
        _stderr.print(f"[bold red]Error:[/bold red] {escape(str(e))}", highlight=False, soft_wrap=True)
        raise typer.Exit(e.exit_code) from None
