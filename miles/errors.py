"""Error types that decide how `miles` exits.

A `UserError` is a mistake the user can fix (bad flag value, missing file, contradictory options):
the CLI prints its one-sentence message and exits with code 2, without a traceback. Anything else is
an internal error and keeps its traceback.
"""

from __future__ import annotations


class UserError(Exception):
    """A mistake the user can fix. The message is one sentence naming the option and the fix."""

    exit_code = 2

    def __init__(self, message: str, *, option: str | None = None):
        super().__init__(message)
        self.option = option


class MissingInput(UserError):
    """A file or directory the run reads is not there (a user error; `miles docs check` tells it apart
    from a configuration error, since a documented command's inputs need not exist where docs are checked)."""


class StepFailed(RuntimeError):
    """An internal step failed; the message says which step and what it was doing."""
