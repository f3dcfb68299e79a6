"""Generate Typer/Click parameters from option declarations (recipe and engine dataclasses).

Each `OptionSpec` becomes one option: `--x/--no-x` for bools (tri-state bools keep None when neither
is given), a Click choice for `Literal`, repeatable options for lists. The default shown is the one
that will really apply (recipe value > environment variable > declared default), written by the same
`format_value` as the options table and the docs; derived options show their rule instead.
"""

from __future__ import annotations

import inspect
from typing import Annotated, Any, Callable, Literal, Optional

import typer
from rich.markup import escape

from miles.config.engine import OptionSpec
from miles.config.values import format_value

NO_DEFAULT = object()


def help_text(spec: OptionSpec, default: Any = NO_DEFAULT) -> str:
    """The help line: text, derived rule or `[default: X]`, environment variable, and what is unavailable."""
    parts = [spec.help]
    if spec.env:
        parts.append(f"Env: {spec.env}.")
    if spec.unsupported:
        parts.append(f"Not available in this build: {spec.unsupported}.")
    shown = shown_default(spec, default) if default is not NO_DEFAULT else False
    if shown is not False:
        parts.append(f"[default: {shown}]")
    elif spec.derived is not None:
        parts.append(f"[derived: {spec.derived.text}]")
    return " ".join(parts)


def annotation_of(spec: OptionSpec) -> Any:
    if spec.kind == "list":
        return Optional[list[spec.base_type]]  # type: ignore[name-defined]
    if spec.kind == "choice":
        lit = Literal[spec.choices]  # type: ignore[valid-type]
        return Optional[lit] if spec.optional else lit
    base = spec.base_type
    return Optional[base] if (spec.optional or spec.kind == "tristate") else base


def shown_default(spec: OptionSpec, default: Any) -> str | bool:
    """What `[default: ...]` says; False when a derived option is unset (its help states the rule instead)."""
    if spec.derived is not None and default is None:
        return False
    return format_value(default)


def make_parameter(spec: OptionSpec, default: Any, *, envvar: str | None = None, hidden: bool = False) -> inspect.Parameter:
    decls = [f"{spec.flag}/--no-{spec.flag[2:]}"] if spec.kind in ("bool", "tristate") else [spec.flag]
    # Help is rendered as rich markup: escape it so "[default: x]" is shown, not parsed as a style tag.
    kwargs: dict[str, Any] = dict(help=escape(help_text(spec, default)), rich_help_panel=spec.panel, show_default=False)
    if hidden:  # parsed as usual, listed only where it applies (e.g. SGLang options under --rollout-backend sglang)
        kwargs["hidden"] = True
    if envvar:
        kwargs["envvar"] = envvar
        kwargs["show_envvar"] = True
    if spec.field.metadata.get("metavar"):
        kwargs["metavar"] = spec.field.metadata["metavar"]
    value = list(default) if isinstance(default, (list, tuple)) else default
    return inspect.Parameter(
        spec.name,
        inspect.Parameter.KEYWORD_ONLY,
        default=value,
        annotation=Annotated[annotation_of(spec), typer.Option(*decls, **kwargs)],
    )


def with_signature(func: Callable[..., Any], parameters: list[inspect.Parameter]) -> Callable[..., Any]:
    """Give `func(**kwargs)` an explicit signature so Typer builds its options from `parameters`."""
    func.__signature__ = inspect.Signature(parameters)  # type: ignore[attr-defined]
    return func


def commandline_values(ctx: typer.Context, kwargs: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """The subset of `kwargs` the user gave on the command line (or via an environment variable)."""
    out = {}
    for name in names:
        source = ctx.get_parameter_source(name)
        if source is not None and source.name in ("COMMANDLINE", "ENVIRONMENT"):
            value = kwargs[name]
            out[name] = list(value) if isinstance(value, tuple) else value
    return out
