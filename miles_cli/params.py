"""Generate Typer/Click parameters from option declarations (recipe, engine, run, convert, docker-build).

Each `OptionSpec` becomes one option: `--x/--no-x` for bools (tri-state bools keep None when neither
is given), a Click choice for `Literal`, repeatable options for lists. The parameter carries the
`FlagDoc` it was made from (`param.miles_doc`), which is what `--help` renders (miles_cli/help.py):
help and the parser are built from the same declaration, so they cannot disagree.
"""

from __future__ import annotations

import inspect
from typing import Annotated, Any, Callable, Literal, Optional

import typer

from miles.config.engine import OptionSpec
from miles.docs.flag import FlagDoc
from miles_cli.options import NO_VALUE, flag_doc, help_line

PARAMETER_DOCS = "__miles_flag_docs__"
"""Attribute of a command function: {parameter name: FlagDoc}, read by the help renderer and the docs."""


def annotation_of(spec: OptionSpec) -> Any:
    if spec.kind == "list":
        return Optional[list[spec.base_type]]  # type: ignore[name-defined]
    if spec.kind == "choice":
        lit = Literal[spec.choices]  # type: ignore[valid-type]
        return Optional[lit] if spec.optional else lit
    base = spec.base_type
    return Optional[base] if (spec.optional or spec.kind == "tristate") else base


def make_parameter(
    spec: OptionSpec, value: Any = NO_VALUE, *, envvar: str | None = None, doc: FlagDoc | None = None
) -> tuple[inspect.Parameter, FlagDoc]:
    """The Typer parameter for `spec` and the FlagDoc that help shows for it.

    `value` is the default this invocation really uses (shown by help); the parser's own default is
    the same value, or None for derived options left to `resolve()`.
    """
    doc = doc or flag_doc(spec, value, env=envvar)
    decls = [f"{spec.flag}/--no-{spec.flag[2:]}"] if spec.kind in ("bool", "tristate") else [spec.flag]
    kwargs: dict[str, Any] = dict(help=help_line(doc), rich_help_panel=spec.panel, show_default=False)
    if envvar:
        kwargs["envvar"] = envvar
    if spec.field.metadata.get("metavar"):
        kwargs["metavar"] = spec.field.metadata["metavar"]
    if spec.required:
        default: Any = inspect.Parameter.empty
    else:
        default = None if value is NO_VALUE or spec.derived is not None else value
        default = list(default) if isinstance(default, (list, tuple)) else default
    parameter = inspect.Parameter(
        spec.name,
        inspect.Parameter.KEYWORD_ONLY,
        default=default,
        annotation=Annotated[annotation_of(spec), typer.Option(*decls, **kwargs)],
    )
    return parameter, doc


def with_signature(func: Callable[..., Any], parameters: list[tuple[inspect.Parameter, FlagDoc | None]]) -> Callable[..., Any]:
    """Give `func(**kwargs)` an explicit signature so Typer builds its options from `parameters`."""
    func.__signature__ = inspect.Signature([p for p, _ in parameters])  # type: ignore[attr-defined]
    setattr(func, PARAMETER_DOCS, {p.name: d for p, d in parameters if d is not None})
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
