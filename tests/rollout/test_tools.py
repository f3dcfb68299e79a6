"""The built-in tools and the tool-call parser: the python tool's limits hold, the calculator is exact."""

from __future__ import annotations

import asyncio
import os
import time

import pytest

from miles.rollout.tools.builtin import execute_tool
from miles.rollout.tools.calculator import CalculatorError, calculate
from miles.rollout.tools.parsers import parse_qwen25
from miles.rollout.tools.python_sandbox import run_python


def run(coro):
    return asyncio.run(coro)


def test_python_tool_returns_what_the_code_prints():
    assert run(run_python("print(sum(range(10)))")) == "45"
    assert run(execute_tool("python", {"code": "import math\nprint(math.factorial(5))"})) == "120"


def test_a_runaway_python_tool_is_killed_within_its_limit():
    t0 = time.monotonic()
    out = run(run_python("while True:\n    pass", timeout_s=1.5))
    took = time.monotonic() - t0
    assert out.startswith("Error:") and ("1.5 s" in out)
    assert took < 5, f"the tool took {took:.1f}s to stop"


def test_a_sleeping_python_tool_and_its_children_are_killed():
    code = "import subprocess, sys\nsubprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\nimport time; time.sleep(60)"
    t0 = time.monotonic()
    out = run(run_python(code, timeout_s=1.0))
    assert out.startswith("Error: the code ran longer than 1 s") and time.monotonic() - t0 < 5


def test_python_tool_memory_is_limited():
    out = run(run_python("x = bytearray(2 * 1024**3)\nprint('allocated')", memory_mb=256))
    assert out.startswith("Error") and "MemoryError" in out and "allocated" not in out


def test_python_tool_has_no_network():
    import socket

    with socket.socket() as server:  # a listener it could reach if it had the host's network
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        port = server.getsockname()[1]
        code = f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=2)\nprint('connected')"
        out = run(run_python(code))
    assert "connected" not in out and out.startswith("Error"), out


def test_python_tool_runs_in_a_temporary_directory_that_is_removed():
    out = run(run_python("import os\nopen('f.txt', 'w').write('x')\nprint(os.getcwd())"))
    assert "miles-python-tool-" in out and not os.path.exists(out.strip())


def test_python_tool_errors_are_answers():
    assert run(run_python("raise ValueError('bad input')")) == "Error: ValueError: bad input"
    assert run(run_python("print(1")).startswith("Error: SyntaxError")
    assert run(execute_tool("python", {})).startswith("Error: python takes one argument")


def test_calculator_is_exact_and_refuses_what_is_not_arithmetic():
    assert calculate("123*45") == "5535"
    assert calculate("(2+3)**2 - 7 // 2") == "22"
    assert calculate("1/4") == "0.25"
    assert calculate("-3 % 5") == "2"
    for bad in ("__import__('os')", "2**99999", "1/0", "a+1", ""):
        with pytest.raises(CalculatorError):
            calculate(bad)
    assert run(execute_tool("calculator", {"expression": "9*9"})) == "81"
    assert run(execute_tool("nope", {})).startswith("Error: unknown tool 'nope'")


def test_qwen25_parser_reads_calls_and_reports_broken_ones():
    text = 'thinking<tool_call>\n{"name": "calculator", "arguments": {"expression": "1+1"}}\n</tool_call><tool_call>{"name": "python", "arguments": "{\\"code\\": \\"print(1)\\"}"}</tool_call><tool_call>{oops}</tool_call>'
    content, calls = parse_qwen25(text)
    assert content == "thinking"
    assert [(c.name, c.arguments, c.error is None) for c in calls[:2]] == [("calculator", {"expression": "1+1"}, True), ("python", {"code": "print(1)"}, True)]
    assert calls[2].error and "not valid JSON" in calls[2].error
    assert parse_qwen25("no calls here") == ("no calls here", [])
