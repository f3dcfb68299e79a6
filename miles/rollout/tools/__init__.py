"""Tools a multi-turn rollout can call, and the parsing of the model's tool calls.

- `parsers`: the model family's tool-call text format -> `ToolCall`s (`--generate-tool-call-parser`).
- `calculator`, `python_sandbox`: the built-in tools (safe arithmetic; Python in a limited subprocess).
- `builtin`: their OpenAI-style specs (`TOOL_SPECS`) and `execute_tool(name, params) -> str`, the default
  of `--generate-execute-tool-function-path`.

A tool never raises into the rollout: every failure is a string the model reads as the tool's answer.
Imports neither torch nor Ray.
"""
