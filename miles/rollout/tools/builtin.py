"""The built-in tools, `calculator` and `python`: their specs and the default executor.

    --generate-execute-tool-function-path miles.rollout.tools.builtin.execute_tool   (the default)

`execute_tool(name, params) -> str` is the contract of `--generate-execute-tool-function-path`: an async
function from a tool name and its JSON arguments to the text the model reads back. Unknown tools, bad
arguments and failures come back as `Error: ...` text, never as an exception.
"""

from __future__ import annotations

from typing import Any

from miles.rollout.tools.calculator import CalculatorError, calculate
from miles.rollout.tools.python_sandbox import run_python

ERROR_PREFIX = "Error: "
"""Tool answers that start with this count as tool errors (rollout/tool_error_rate)."""

TOOL_SPECS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression exactly (+ - * / // % ** and parentheses).",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string", "description": "e.g. 123*45"}},
                "required": ["expression"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "python",
            "description": "Run a Python snippet (no network, limited time and memory) and return what it prints.",
            "parameters": {
                "type": "object",
                "properties": {"code": {"type": "string", "description": "Python source; print the result."}},
                "required": ["code"],
            },
        },
    },
]


async def execute_tool(name: str, params: dict[str, Any]) -> str:
    """Run built-in tool `name` with `params`; its answer, or `Error: ...`."""
    if name == "calculator":
        if set(params) - {"expression"} or "expression" not in params:
            return f"{ERROR_PREFIX}calculator takes one argument, expression (got {sorted(params)})."
        try:
            return calculate(params["expression"])
        except CalculatorError as e:
            return f"{ERROR_PREFIX}{e}"
    if name == "python":
        if "code" not in params:
            return f"{ERROR_PREFIX}python takes one argument, code (got {sorted(params)})."
        return await run_python(params["code"])
    return f"{ERROR_PREFIX}unknown tool {name!r}; the tools are calculator, python."
