"""Load `--custom-generate-function-path` and `--rollout-function-path` (module.fn or path/to/file.py:fn).

Both must name an `async def` function (or an object whose `__call__` is one); anything else is a
user error naming the option (exit 2), raised when the run's inputs are checked, before anything starts.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Awaitable, Callable
from typing import Any

from miles.errors import UserError
from miles.utils.load_function import load_function

GENERATE_FLAG = "--custom-generate-function-path"
ROLLOUT_FLAG = "--rollout-function-path"


def _async_function(path: str, *, flag: str, signature: str) -> Callable[..., Awaitable[Any]]:
    fn = load_function(path, flag=flag)
    if inspect.isclass(fn) or not (inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))):
        what = "a class" if inspect.isclass(fn) else ("not callable" if not callable(fn) else "not an async function")
        raise UserError(f"{flag} {path} is {what}; it must name `{signature}` (miles.rollout.generate_hub.types).", option=flag)
    return fn


@functools.lru_cache(maxsize=None)
def load_generate_function(path: str | None) -> Callable[..., Awaitable[Any]]:
    """The generate function `path` names; the single-turn default when `path` is empty."""
    if not path:
        from miles.rollout.generate_hub.single_turn import generate

        return generate
    return _async_function(path, flag=GENERATE_FLAG, signature="async def generate(input: GenerateInput) -> GenerateOutput")


@functools.lru_cache(maxsize=None)
def load_rollout_function(path: str | None) -> Callable[..., Awaitable[Any]] | None:
    """The rollout function `path` names; None (the built-in rollout) when `path` is empty."""
    if not path:
        return None
    return _async_function(path, flag=ROLLOUT_FLAG, signature="async def rollout(input: RolloutFnInput) -> RolloutFnOutput")
