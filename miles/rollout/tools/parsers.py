"""Tool-call parsers: the text of one model turn -> the tool calls it makes (`--generate-tool-call-parser`).

`qwen25` is the format of Qwen2.5 and Qwen3 (SGLang's parser of the same name): each call is

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "12*34"}}
    </tool_call>

repeatable. Unlike SGLang's detector, a block that is not valid JSON, or lacks a name, is not dropped: it
comes back as a `ToolCall` with `error` set, so the model is told what was wrong instead of the turn
silently counting as final.
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any, Callable

PARSERS = ("qwen25",)


@dataclasses.dataclass
class ToolCall:
    """One call the model asked for: `name` and `arguments`, or `error` when the block cannot be read."""

    name: str
    arguments: dict[str, Any]
    raw: str
    """The JSON text between the tags, as the model wrote it."""
    error: str | None = None


_QWEN_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def parse_qwen25(text: str) -> tuple[str, list[ToolCall]]:
    """(the text before the first call, the calls in order)."""
    calls = []
    for m in _QWEN_BLOCK.finditer(text):
        raw = m.group(1).strip()
        try:
            obj = json.loads(raw)
        except json.JSONDecodeError as e:
            calls.append(ToolCall("", {}, raw, error=f"the tool call is not valid JSON ({e.msg} at char {e.pos})"))
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
            calls.append(ToolCall("", {}, raw, error='the tool call must be a JSON object {"name": ..., "arguments": {...}}'))
            continue
        args = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):  # some models write the arguments as a JSON string
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError:
                pass
        if not isinstance(args, dict):
            calls.append(ToolCall(obj["name"], {}, raw, error="the tool call's arguments must be a JSON object"))
            continue
        calls.append(ToolCall(obj["name"], args, raw))
    start = text.find("<tool_call>")
    return (text if start < 0 else text[:start]), calls


def get_parser(name: str) -> Callable[[str], tuple[str, list[ToolCall]]]:
    """The parser called `name` (one of `PARSERS`)."""
    if name == "qwen25":
        return parse_qwen25
    raise KeyError(name)
