"""Turn option values given as text (engine argv, `--extra-args`, environment variables) into typed values.

The Typer layer converts the flags it parses itself; this module handles the other ways an engine
option can arrive — `--extra-args "..."`, the tokens after `--`, and environment variables such as
PROMETHEUS_PORT — with the same types, the same choices and the same one-sentence errors.
"""

from __future__ import annotations

import difflib
from typing import Any, Iterable

from miles.config.engine import OptionSpec, option_specs
from miles.errors import UserError

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def parse_scalar(spec: OptionSpec, text: str, *, source: str) -> Any:
    """Convert one text value for `spec`; `source` names where it came from in error messages."""
    if spec.optional and text.lower() in {"none", "null"}:
        return None
    base = spec.base_type
    try:
        if base is bool:
            low = text.lower()
            if low in _TRUE:
                return True
            if low in _FALSE:
                return False
            raise ValueError
        value = base(text)
    except ValueError:
        kind = "true or false" if base is bool else f"a{'n' if base is int else ''} {base.__name__}"
        raise UserError(f"{source}: {text!r} is not {kind}; give {spec.flag} {kind}.", option=spec.flag) from None
    if spec.choices is not None and value not in spec.choices:
        raise UserError(
            f"{source}: {text!r} is not one of {', '.join(map(str, spec.choices))}; pick one of those for {spec.flag}.",
            option=spec.flag,
        )
    return value


def unknown_flag_error(flag: str, known: Iterable[str], *, where: str) -> UserError:
    known = list(known)
    close = difflib.get_close_matches(flag, known, n=3, cutoff=0.6)
    hint = f" Did you mean {' or '.join(close)}?" if close else " Run the command with --help to list the options."
    return UserError(f"No such option {flag} in {where}.{hint}", option=flag)


def split_args(text: str, *, where: str) -> list[str]:
    """Split a flags string the way a shell would; an unbalanced quote is a user error."""
    import shlex

    try:
        return shlex.split(text)
    except ValueError as e:
        raise UserError(f"{where} {text!r} cannot be split into flags ({e}); balance its quotes.", option=where) from None


def parse_engine_argv(tokens: list[str], *, where: str, recipe_flags: Iterable[str] = ()) -> dict[str, Any]:
    """Parse engine flags (`--rollout-batch-size 8 --colocate --no-offload-train ...`) into `{field: value}`.

    Later occurrences win, as on a command line.
    """
    by_flag = {s.flag: s for s in option_specs()}
    negations = {"--no-" + s.flag[2:]: s for s in option_specs() if s.kind in ("bool", "tristate")}
    values: dict[str, Any] = {}
    i = 0
    while i < len(tokens):
        token = tokens[i]
        if not token.startswith("--"):
            raise UserError(f"Unexpected value {token!r} in {where}; every value must follow its --flag.")
        flag, eq, inline = token.partition("=")
        i += 1
        if flag in negations and not eq:
            values[negations[flag].name] = False
            continue
        spec = by_flag.get(flag)
        if spec is None:
            from miles.config.sglang import removed_flag_error

            removed = removed_flag_error(flag)
            if removed is not None:
                raise removed
            if flag in recipe_flags:
                raise UserError(f"{flag} is a recipe option, not an engine flag; give it on the command line, not in {where}.", option=flag)
            raise unknown_flag_error(flag, list(by_flag) + list(negations), where=where)
        source = f"{flag} in {where}"
        if spec.kind in ("bool", "tristate"):
            values[spec.name] = parse_scalar(spec, inline, source=source) if eq else True
        elif spec.kind == "list":
            items = [inline] if eq else []
            while i < len(tokens) and not tokens[i].startswith("--"):
                items.append(tokens[i])
                i += 1
            if not items:
                raise UserError(f"{flag} in {where} needs at least one value.", option=flag)
            values[spec.name] = [parse_scalar(spec, t, source=source) for t in items]
        else:
            if eq:
                text = inline
            elif i < len(tokens) and not (tokens[i].startswith("--") and len(tokens[i]) > 2):
                text = tokens[i]
                i += 1
            else:
                raise UserError(f"{flag} in {where} needs a value.", option=flag)
            values[spec.name] = parse_scalar(spec, text, source=source)
    return values


def format_value(value: Any) -> str:
    """How a value is written in help, tables and docs (the same text everywhere)."""
    if value is None:
        return "None"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return " ".join(format_value(v) for v in value) if value else "[]"
    if value == "":
        return '""'
    return str(value)
