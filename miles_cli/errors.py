"""How user errors leave the program: `Error: <one sentence>` on stderr and exit code 2, no traceback."""

from __future__ import annotations

import click


class UsageFailure(click.ClickException):
    """A `miles.errors.UserError` on its way out of a command."""

    exit_code = 2
