"""Option declarations → `FlagDoc`: the one description of every option that help, docs and the parser share.

`miles <command> --help` renders these objects (miles_cli/help.py), `docs/reference/cli.md` is
generated from them (miles/docs/cli_reference.py), and the Typer parameters that parse the command
line are made from the same declarations (miles_cli/params.py). The value a `FlagDoc` shows is the
one this invocation will use: the run commands pass the values resolved for the recipe, mode,
environment variables and flags given, so `--run-id foo --help` shows `--save runs/foo/checkpoints`.

Also declared here, like every other option: the "Run" panel of the run commands (`--dry-run`,
`--checkpoint`). Nothing here imports anything heavy.

    python -c "from miles_cli.options import flag_doc; ..."   # used by miles_cli, not run directly
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from miles.config.engine import OptionSpec, spec, specs_of
from miles.config.fields import option
from miles.config.values import format_value
from miles.docs.flag import FlagDoc

NO_VALUE = object()
"""A derived option whose value is not known for this invocation: help states only its rule."""


def _dry_run() -> bool:
    return option(False, help="Resolve and print every option (and the prepare steps), then stop without running anything.")


@dataclass
class RunControls:
    """Options of `full-train` and `train` that steer the command itself, not the run's configuration."""

    dry_run: bool = _dry_run()


@dataclass
class EvalControls:
    """`miles eval` takes the model to evaluate, first, and --dry-run."""

    checkpoint: str | None = option(
        None, help="Model to evaluate: a Hugging Face directory or a miles checkpoint directory; unset = --hf-checkpoint."
    )
    dry_run: bool = _dry_run()


RUN_PANEL = "Run"


def run_control_specs(command: str) -> list[OptionSpec]:
    return specs_of(EvalControls if command == "eval" else RunControls, "run", RUN_PANEL)


def type_name(s: OptionSpec) -> str:
    """The type as the reference docs write it: int, float, str, bool, list[str], or the metavar."""
    metavar = s.field.metadata.get("metavar")
    if metavar:
        return metavar
    if s.kind in ("bool", "tristate"):
        return "bool"
    if s.kind == "list":
        return f"list[{s.base_type.__name__}]"
    return s.base_type.__name__


def metavar(fd: FlagDoc) -> str:
    """What follows the flag in help: nothing for booleans, CHOICE (listed in the text), INT, TEXT..."""
    if fd.type == "bool":
        return ""
    if fd.choices or fd.unavailable_choices:
        return "CHOICE"
    base = fd.type[5:-1] if fd.type.startswith("list[") else fd.type
    name = {"int": "INT", "float": "FLOAT", "str": "TEXT"}.get(base, base)
    return name + "..." if fd.repeatable else name


def linked_spec(s: OptionSpec) -> OptionSpec | None:
    """The engine option a recipe option is the user-facing name of."""
    return spec(s.engine) if s.engine else None


def help_sentence(s: OptionSpec) -> str:
    """The declared help, plus what the declaration implies (the engine option it sets, its environment)."""
    parts = [s.help]
    target = linked_spec(s)
    if target is not None and target.flag != s.flag:
        parts.append(f"(The engine option {target.flag}; it has no flag of its own.)")
    run_env = (target or s).run_env
    if run_env:
        parts.append("When on, the run's processes get " + ", ".join(f"{k}={v}" for k, v in run_env.items()) + ".")
    return " ".join(parts)


def flag_doc(s: OptionSpec, value: Any = NO_VALUE, *, env: str | None = None) -> FlagDoc:
    """The FlagDoc of one declared option; `value` is what this invocation uses (NO_VALUE: unknown)."""
    target = linked_spec(s)
    unavailable = s.unavailable
    if not unavailable and target is not None and s.field.metadata.get("to_engine") is None:
        unavailable = target.unavailable  # same values as the engine option: same verdict
    flags = (s.flag, "--no-" + s.flag[2:]) if s.kind in ("bool", "tristate") else (s.flag,)
    required = s.required
    default = derived_value = None
    if not required:
        if s.derived is not None:
            derived_value = None if value is NO_VALUE else format_value(value)
        elif value is not NO_VALUE:
            default = format_value(value)
    return FlagDoc(
        flags=flags,
        name=s.name,
        panel=s.panel,
        type=type_name(s),
        choices=tuple(str(c) for c in s.choices if c not in unavailable) if s.choices else (),
        default=default,
        default_value=None if value is NO_VALUE else value,
        required=required,
        derived=s.derived.text if s.derived is not None else None,
        env=env or s.env,
        unsupported=s.unsupported,
        help=help_sentence(s),
        repeatable=s.kind == "list",
        unavailable_choices=tuple((str(c), why) for c, why in unavailable.items()),
        derived_value=derived_value,
    )


def help_line(fd: FlagDoc) -> str:
    """The text `--help` prints for one option (after the flag and metavar)."""
    parts = [fd.help] if fd.help else []
    if fd.choices:
        parts.append("One of: " + ", ".join(fd.choices) + ".")
    for choice, why in fd.unavailable_choices:
        parts.append(f"Not in this build: {choice}, because {why}.")
    if fd.repeatable:
        parts.append("Repeatable; several values may follow one flag.")
    if fd.env:
        parts.append(f"Env: {fd.env}.")
    if fd.unsupported:
        parts.append(f"Not available in this build: {fd.unsupported}.")
    if fd.required:
        parts.append("[required]")
    elif fd.derived is not None and fd.derived_value is not None:
        parts.append(f"[default: {fd.derived_value}; derived: {fd.derived}]")
    elif fd.default is not None:
        parts.append(f"[default: {fd.default}]")
    elif fd.derived is not None:
        parts.append(f"[derived: {fd.derived}]")
    return " ".join(parts)
