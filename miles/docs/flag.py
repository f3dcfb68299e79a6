"""`FlagDoc`: one option of one command as help and the reference docs describe it (plain data).

Its own module because `miles train --help` renders FlagDocs and needs nothing else of
`miles.docs.model` (each dataclass costs start-up time; see docs/benchmarks.md "CLI start-up").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class FlagDoc:
    """One option of one command, as `--help` shows it for the default recipe."""

    flags: tuple[str, ...]  # "--x" and, for booleans, "--no-x"
    name: str  # the parameter (field) name
    panel: str  # the help panel ("Rollout", "Recipe", "Run", ...)
    type: str  # "int", "bool", "hf|torch_dist", "list[str]", "KEY=VALUE", ...
    choices: tuple[str, ...]  # empty unless the option takes one of a fixed set
    default: str | None  # the text of `[default: X]`; None when help shows none
    default_value: Any  # the Python default of the parameter (what the parser applies)
    required: bool
    derived: str | None  # the derived-default rule text, when the default depends on other options
    env: str | None  # an environment variable that sets it (declared `env=` or MILES_SCRIPT_<FIELD>)
    unsupported: str | None  # why it cannot take a non-default value in this build
    help: str  # the help sentence(s), without the default/env/derived annotations
    repeatable: bool = False
    unavailable_choices: tuple[tuple[str, str], ...] = ()  # (choice, why this build rejects it)
    derived_value: str | None = None  # what the derived rule gives for the invocation help was built for

    @property
    def flag(self) -> str:
        return self.flags[0]
