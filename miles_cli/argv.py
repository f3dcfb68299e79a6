"""Read one option's value from a command line before any parser exists (standard library only).

`miles` must know a few values before it can build the command that parses them: which recipe
(`--model-name`) a run command's options come from, and whether a help request can be answered
straight from the declarations (miles_cli/fast_help.py). Both read the same spelling Click accepts,
`--flag value` or `--flag=value`, the last one winning, and stop at `--` (what follows is engine
flags, never the command's own options).

    flag_value(["train", "--model-name", "qwen3-4b", "--help"], "--model-name")   # 'qwen3-4b'
"""

from __future__ import annotations

from typing import NamedTuple, Sequence


def flag_value(argv: Sequence[str], flag: str) -> str | None:
    """The value of `flag` in `argv` (`--flag value` or `--flag=value`, last wins, before `--`), else None."""
    value = None
    for i, token in enumerate(argv):
        if token == "--":
            break
        if token == flag and i + 1 < len(argv):
            value = argv[i + 1]
        elif token.startswith(flag + "="):
            value = token[len(flag) + 1 :]
    return value


class HelpRequest(NamedTuple):
    """A run command's arguments that only ask for its help (miles_cli/fast_help.py)."""

    group: str | None  # None: --help; "all": --help-all; else the value of --help-group
    model_name: str | None  # the last --model-name, if any


def help_request(args: Sequence[str]) -> HelpRequest | None:
    """`args` (what follows `miles <command>`) as a help request: exactly one of `--help`, `--help-all`
    and `--help-group GROUP`, and any number of `--model-name NAME`; None for anything else (another
    flag, `--`, a value that looks like a flag), which needs the command's own parser."""
    group = model_name = None
    helps = i = 0
    while i < len(args):
        token = args[i]
        name, eq, value = token.partition("=")
        if token in ("--help", "--help-all"):
            helps += 1
            group = None if token == "--help" else "all"
        elif name in ("--help-group", "--model-name"):
            if not eq:
                if i + 1 == len(args):
                    return None
                i += 1
                value = args[i]
            if not value or value.startswith("-"):
                return None
            if name == "--model-name":
                model_name = value
            else:
                helps += 1
                group = value
        else:
            return None
        i += 1
    return HelpRequest(group, model_name) if helps == 1 else None
