"""How user errors leave the program: `Error: <one sentence>` on stderr and exit code 2, no traceback."""

from __future__ import annotations

import contextlib
from typing import Iterator

import typer

from miles.errors import UserError
from miles_cli.help import print_error

last_error: UserError | None = None  # the latest user error reported (read by `miles docs check`, in-process)


@contextlib.contextmanager
def user_errors_exit_2() -> Iterator[None]:
    """Turn a `UserError` raised inside a command into the one-line message and exit code 2."""
    try:
        yield
    except UserError as e:
        global last_error
        last_error = e
        print_error(str(e))  # rich is imported here, not on the help path
        raise typer.Exit(e.exit_code) from None
