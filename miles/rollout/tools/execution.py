"""Running the model's tool calls: loading the executor and the tool specs, and turning every failure
into an answer the model reads.

    --generate-execute-tool-function-path  async fn(name: str, params: dict) -> str  (default: the built-ins)
    --generate-tool-specs-path             a list of OpenAI tool dicts: module.attr, file.py:attr or a .json file

A call whose JSON is invalid, whose tool is unknown, whose tool raises, returns something that is not
text, or runs past `TOOL_TIMEOUT_S` gets an `Error: ...` answer; it counts as a tool error.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import json
from pathlib import Path
from typing import Any, Awaitable, Callable

from miles.errors import UserError
from miles.rollout.tools.builtin import ERROR_PREFIX
from miles.rollout.tools.parsers import ToolCall
from miles.utils.load_function import load_function

EXECUTE_FLAG = "--generate-execute-tool-function-path"
SPECS_FLAG = "--generate-tool-specs-path"
TOOL_TIMEOUT_S = 120.0
"""Longest wait for one tool call (a user's executor that hangs must not hang the rollout)."""

ExecuteTool = Callable[[str, dict[str, Any]], Awaitable[Any]]


@functools.lru_cache(maxsize=None)
def load_execute_tool(path: str | None) -> ExecuteTool:
    """The executor `path` names (an async function of (name, params)); the built-in tools when empty."""
    if not path:
        from miles.rollout.tools.builtin import execute_tool

        return execute_tool
    fn = load_function(path, flag=EXECUTE_FLAG)
    if inspect.isclass(fn) or not (inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))):
        raise UserError(
            f"{EXECUTE_FLAG} {path} is not an async function; it must name `async def execute(name: str, params: dict) -> str`.",
            option=EXECUTE_FLAG,
        )
    return fn


def _check_specs(specs: Any, where: str) -> list[dict[str, Any]]:
    ok = isinstance(specs, (list, tuple)) and all(isinstance(t, dict) and tool_name(t) for t in specs)
    if not ok:
        raise UserError(
            f"{SPECS_FLAG} {where} must be a list of OpenAI tool dicts "
            '({"type": "function", "function": {"name": ..., "parameters": {...}}}).',
            option=SPECS_FLAG,
        )
    return [dict(t) for t in specs]


@functools.lru_cache(maxsize=None)
def _load_specs(path: str) -> tuple[dict[str, Any], ...]:
    if path.endswith(".json"):
        p = Path(path)
        if not p.is_file():
            raise UserError(f"{SPECS_FLAG} {path}: no such file; give a .json file or module.attr naming the list.", option=SPECS_FLAG)
        try:
            specs = json.loads(p.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise UserError(f"{SPECS_FLAG} {path} is not valid JSON ({e}); fix the file.", option=SPECS_FLAG) from None
    else:
        specs = load_function(path, flag=SPECS_FLAG)
    return tuple(_check_specs(specs, path))


def load_tool_specs(path: str | None) -> list[dict[str, Any]] | None:
    """The tool specs `path` names, checked; None when empty."""
    return None if not path else [dict(t) for t in _load_specs(path)]


def tool_name(spec: dict[str, Any]) -> str | None:
    f = spec.get("function", spec)
    name = f.get("name") if isinstance(f, dict) else None
    return name if isinstance(name, str) and name else None


async def run_tool_call(execute: ExecuteTool, call: ToolCall, known: set[str] | None) -> tuple[str, bool]:
    """(the answer the model reads, whether it is an error) for one parsed call."""
    if call.error is not None:
        return f"{ERROR_PREFIX}{call.error}.", True
    if known is not None and call.name not in known:
        return f"{ERROR_PREFIX}unknown tool {call.name!r}; the tools are {', '.join(sorted(known))}.", True
    try:
        answer = await asyncio.wait_for(execute(call.name, dict(call.arguments)), timeout=TOOL_TIMEOUT_S)
    except asyncio.TimeoutError:
        return f"{ERROR_PREFIX}the tool {call.name} did not answer within {TOOL_TIMEOUT_S:g} s.", True
    except Exception as e:  # noqa: BLE001 - a tool's failure is the model's information, not the run's
        return f"{ERROR_PREFIX}the tool {call.name} failed: {type(e).__name__}: {e}", True
    if not isinstance(answer, str):
        try:
            answer = json.dumps(answer)
        except (TypeError, ValueError):
            return f"{ERROR_PREFIX}the tool {call.name} returned a {type(answer).__name__}, not text.", True
    return answer, answer.startswith(ERROR_PREFIX)
