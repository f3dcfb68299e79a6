"""Turn option values into Python values without building a pydantic `TypeAdapter` per option.

Typer 0.29 coerces every parameter through a pydantic `TypeAdapter`, built the first time the
parameter processes a value; `miles train` has several hundred options (all of SGLang's), so parsing
one command line imported pydantic and built hundreds of adapters (most of `miles train --help`'s
time). `install(command)` gives each parameter whose type is one miles declares (str, int, float,
bool, a `Literal` of choices, or a list of those) a coercion in plain Python that returns what the
adapter returns for well-formed input. Anything else — a malformed number, an unusual spelling of a
boolean, a value that is not a choice — goes to Typer's own adapter, so the value, and every error
message and exception (with the pydantic error as its cause, which miles_cli/help.py reads), is
Typer's. tests/cli/test_coerce.py checks both paths against Typer's adapters.

    python -X importtime -m miles_cli.main train --lr 1e-5 --help 2>&1 | grep -c pydantic    # 0
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, get_args, get_origin

from typer._coercion import RuntimeParam, TypeDescriptor, build_runtime_param
from typer._param_types import coerce_cli_choice
from typer._typing import is_literal_type, literal_values

_INT = re.compile(r"[+-]?(0|[1-9][0-9]{0,17})")
_FLOAT = re.compile(r"[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?")
_TRUE = {"1", "true", "t", "yes", "y", "on"}
_FALSE = {"", "0", "false", "f", "no", "n", "off"}


class _Unsure(Exception):
    """The plain path does not decide this value: Typer's adapter does."""


def _scalar(annotation: Any, value: Any, ctx: Any, case_sensitive: bool) -> Any:
    if annotation is str:
        if not isinstance(value, bytes):  # Typer's str(value) (SGLang declares some str options with int defaults)
            return str(value)
    elif annotation is int:
        if type(value) is int:
            return value
        if isinstance(value, str) and _INT.fullmatch(value):
            return int(value)
    elif annotation is float:
        if type(value) in (int, float):
            return float(value)
        if isinstance(value, str) and _FLOAT.fullmatch(value):
            return float(value)
    elif annotation is bool:
        if type(value) is bool:
            return value
        if isinstance(value, str) and value.strip() in _TRUE | _FALSE:
            return value.strip() in _TRUE
    elif is_literal_type(annotation):
        try:
            return coerce_cli_choice(value, choices=literal_values(annotation), case_sensitive=case_sensitive, ctx=ctx)
        except Exception:
            raise _Unsure from None
    raise _Unsure


def _supported(annotation: Any) -> bool:
    if get_origin(annotation) is list:
        (annotation,) = get_args(annotation)
    return annotation in (str, int, float, bool) or is_literal_type(annotation)


@dataclasses.dataclass(frozen=True)
class PlainRuntimeParam(RuntimeParam):
    """Plain-Python coercion for the well-formed values of miles' option types; Typer's otherwise."""

    descriptor: TypeDescriptor

    def _coerce_value(self, value: Any, param: Any, ctx: Any) -> Any:
        case_sensitive = self.parameter_info.case_sensitive
        try:
            if get_origin(self.annotation) is list:
                (item,) = get_args(self.annotation)
                items = value if isinstance(value, (list, tuple)) else [value]
                return [_scalar(item, v, ctx, case_sensitive) for v in items]
            return _scalar(self.annotation, value, ctx, case_sensitive)
        except _Unsure:
            return build_runtime_param(self.descriptor)._coerce_value(value, param=param, ctx=ctx)


def install(command: Any) -> Any:
    """Give `command`'s parameters (and its subcommands', for a group) the plain coercion; returns it."""
    for sub in getattr(command, "commands", {}).values():
        install(sub)
    install_params(command.params)
    return command


def install_params(params: list[Any]) -> None:
    """The plain coercion for each of `params` that Typer made and has not coerced with yet."""
    for param in params:
        descriptor = getattr(param, "type_descriptor", None)
        if descriptor is None or getattr(param, "_runtime_param", None) is not None:
            continue  # not a Typer parameter, or its coercion is already built
        if descriptor.file_annotation is None and descriptor.parameter_info.parser is None and _supported(descriptor.annotation):
            info = descriptor.parameter_info
            # (Typer routes none of these annotations to its path handling when no parser is given.)
            if info.min is None and info.max is None and info.path_type is None:
                param._runtime_param = PlainRuntimeParam(parameter_info=info, annotation=descriptor.annotation, descriptor=descriptor)
