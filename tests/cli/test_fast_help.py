"""`miles <run command> --help` from the declarations (miles_cli/fast_help.py) prints what the built command prints.

The fast path answers `--help`, `--help-all` and `--help-group G` (with any `--model-name NAME`) of
`full-train`, `train` and `eval` without building the command's Click parameters; everything else,
errors included, goes to the built command. Every case below renders both and compares the bytes:
in-process for every command, recipe and help group, and through the real program (a subprocess of
`python -m miles_cli.main`, the fast path switched off in the second one) for a few, at two widths.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from typer._click import formatting

from miles_cli.argv import HelpRequest, flag_value, help_request
from miles_cli.fast_help import help_text
from tests.cli.helpers import WIDE, dry_run_ok, help_rows, invoke, shown_default, table_rows

MILES = [sys.executable, "-m", "miles_cli.main"]
BUILT = [sys.executable, "-c", (  # the program with the fast path switched off: the built command answers
    "import sys\nimport miles_cli.fast_help as f\nf.help_text = lambda argv: None\n"
    "from miles_cli.main import main\nsys.argv = ['miles'] + sys.argv[1:]\nmain()\n"
)]
RECIPES = ("tiny-qwen3", "qwen3-0.6b", "qwen3-4b", "kimi-k2")  # the embedded default, an HF recipe, two SGLang ones
TRAIN_GROUPS = (
    "recipe", "cluster", "training", "rollout", "data", "eval", "algorithm", "reward", "optimizer", "checkpoint",
    "tracking", "fault-tolerance", "debug", "sglang-launch", "sglang-server", "sglang-router", "run", "sglang",
)  # fmt: skip


def _built(argv: list[str], env: dict[str, str] | None = None) -> str:
    result = invoke(argv, env)
    assert result.exit_code == 0, result.output[-2000:]
    return result.output


def _fast(argv: list[str], monkeypatch: pytest.MonkeyPatch, env: dict[str, str] | None = None) -> str:
    for name, value in {"COLUMNS": "4000", "TERMINAL_WIDTH": "4000", "NO_COLOR": "1", **(env or {})}.items():
        monkeypatch.setenv(name, value)  # what tests/cli/helpers.invoke gives the built command
    monkeypatch.setattr(formatting, "FORCED_WIDTH", 80)  # and Typer's CliRunner (80 columns)
    text = help_text(argv)
    assert text is not None, f"the fast path declined {argv}"
    return text + "\n"  # typer.echo's newline


CASES = [
    *[[c, h] for c in ("full-train", "train", "eval") for h in ("--help", "--help-all")],
    *[["train", "--model-name", r, "--help"] for r in RECIPES[1:]],
    ["full-train", "--model-name=qwen3-4b", "--help-all"],
    ["eval", "--help", "--model-name", "kimi-k2"],
    ["train", "--model-name", "qwen3-4b", "--model-name", "tiny-qwen3", "--help"],  # the last one wins
    *[["train", "--help-group", g] for g in TRAIN_GROUPS],
    ["eval", "--help-group=rollout", "--model-name", "qwen3-4b"],
]


@pytest.mark.parametrize("argv", CASES, ids=[" ".join(a) for a in CASES])
def test_fast_help_is_the_built_commands_help(argv, monkeypatch):
    assert _fast(argv, monkeypatch) == _built(argv)


@pytest.mark.parametrize(
    "env",
    [{"MILES_SCRIPT_MODE": "debug_minimal"}, {"MILES_SCRIPT_RUN_ID": "foo"}, {"MILES_SCRIPT_MODEL_NAME": "qwen3-4b"},
     {"PROMETHEUS_PORT": "9999"}, {"MILES_SCRIPT_EXTRA_ARGS": "--lr 1e-5 --rollout-backend sglang"},
     {"MILES_SCRIPT_NUM_NODES": "not-a-number"}],
)  # fmt: skip
def test_fast_help_shows_the_values_the_environment_gives(env, monkeypatch):
    """Environment variables (recipe options, --extra-args, declared env= defaults, a bad value) reach both alike."""
    for argv in (["train", "--help"], ["train", "--help-all"]):
        assert _fast(argv, monkeypatch, env) == _built(argv, env)


def test_model_name_on_the_command_line_beats_the_environment(monkeypatch):
    """`--model-name` picks the recipe and is its option's value, over MILES_SCRIPT_MODEL_NAME (as Click reads it)."""
    env = {"MILES_SCRIPT_MODEL_NAME": "qwen3-4b"}
    argv = ["train", "--model-name", "tiny-qwen3", "--help"]
    text = _fast(argv, monkeypatch, env)
    assert text == _built(argv, env)
    rows = help_rows(text)
    assert shown_default(rows["--model-name"]) == "tiny-qwen3"
    assert shown_default(rows["--run-id"]) == "tiny-qwen3"


@pytest.mark.parametrize(
    "argv",
    [
        ["train", "--lr", "1e-5", "--help"],  # another flag: the built command reads it (help shows the value)
        ["train", "--help", "--", "--lr", "1e-5"],
        ["train", "--help", "--help-all"],
        ["train", "--help-group", "nope"],  # not a group: the built command's error
        ["eval", "--help-group", "cluster"],  # a group of train, not of eval
        ["train", "--model-name", "nope", "--help"],  # not a recipe: the built command's error
        ["train", "--model-name", "--help"],  # Click reads --help as the recipe's name
        ["train", "--model-name="],
        ["train"],
        ["convert", "--help"],
        ["--help"],
    ],
)
def test_fast_path_declines_what_needs_the_parser(argv):
    assert help_text(argv) is None


def test_fast_path_declines_shell_completion(monkeypatch):
    monkeypatch.setenv("_MILES_COMPLETE", "complete_bash")
    assert help_text(["train", "--help"]) is None


def _run(cmd: list[str], columns: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MILES_SCRIPT_")}
    return subprocess.run(cmd, capture_output=True, text=True, env={**env, "COLUMNS": columns}, timeout=300)


@pytest.mark.parametrize(
    "argv, columns",
    [(["train", "--help"], "80"), (["eval", "--help-all"], "100"), (["full-train", "--model-name", "qwen3-4b", "--help-group", "sglang-server"], "80")],
)
def test_the_program_prints_the_built_commands_help(argv, columns):
    """As users run it: same stdout, same (empty) stderr, exit 0; and the fast one built nothing."""
    code = (
        "import sys, runpy\n"
        f"sys.argv = ['miles'] + {argv!r}\n"
        "try:\n    runpy.run_module('miles_cli.main', run_name='__main__')\n"
        "except SystemExit as e:\n    assert e.code in (0, None), e.code\n"
        "print('BUILT=' + ','.join(m for m in ('miles_cli.coerce', 'rich', 'miles_cli.convert') if m in sys.modules))\n"
    )
    probe = _run([sys.executable, "-c", code], columns)
    assert probe.returncode == 0, probe.stderr[-2000:]
    assert probe.stdout.rstrip().endswith("BUILT="), probe.stdout[-300:]  # no parameter was coerced, rich not imported
    fast, built = _run([*MILES, *argv], columns), _run([*BUILT, *argv], columns)
    assert (fast.returncode, fast.stderr) == (built.returncode, built.stderr) == (0, "")
    assert fast.stdout == built.stdout


def test_help_request_reads_what_click_would():
    assert help_request(["--help"]) == HelpRequest(None, None)
    assert help_request(["--model-name", "a", "--help-all", "--model-name=b"]) == HelpRequest("all", "b")
    assert help_request(["--help-group", "data"]) == HelpRequest("data", None)
    assert help_request(["--help-group=data", "--model-name", "x"]) == HelpRequest("data", "x")
    for declined in ([], ["--help", "--help"], ["--help-group"], ["--help-group", "--help"], ["--help", "-h"],
                     ["--help", "x"], ["--model-name", "a"], ["--help", "--model-name"], ["--help=1"], ["--help", "--"]):  # fmt: skip
        assert help_request(declined) is None, declined


def test_flag_value_is_the_last_before_the_separator():
    assert flag_value(["train", "--model-name", "a", "--model-name=b", "--help"], "--model-name") == "b"
    assert flag_value(["--model-name=a", "--", "--model-name", "b"], "--model-name") == "a"
    assert flag_value(["--model-names", "a", "--model-name"], "--model-name") is None
    assert flag_value(["--model-name="], "--model-name") == ""


def test_recipe_registry_names_are_the_modules_names():
    """The registry imports a recipe when it is looked up; its names must be the modules' own."""
    from recipes import RECIPE_MODULES, RECIPES
    from recipes.catalog import MODULES as CATALOG

    assert {name: RECIPES[name].NAME for name in RECIPES} == {name: name for name in RECIPE_MODULES}
    assert [m.NAME for m in CATALOG] == [n for n, path in RECIPE_MODULES.items() if path.startswith("recipes.catalog.")]


def test_extra_args_from_the_environment_reach_help_and_dry_run(tmp_path):
    """MILES_SCRIPT_EXTRA_ARGS is parsed by the command's parser, which once resolved the environment's
    --extra-args itself to show them: every `miles train` ended in RecursionError."""
    env = {**os.environ, **WIDE, "MILES_SCRIPT_EXTRA_ARGS": "--lr 1e-5"}
    helped = subprocess.run([*MILES, "train", "--help"], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert helped.returncode == 0, helped.stderr[-2000:]
    assert shown_default(help_rows(helped.stdout)["--lr"]) == "1e-05"
    dry = subprocess.run([*MILES, "train", "--dry-run"], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert dry_run_ok(dry), dry.stderr[-2000:]
    assert table_rows(dry.stdout)["--lr"] == ("1e-05", "--extra-args")


def test_wrap_words_is_textwraps_wrap(monkeypatch):
    """Help wraps with its own greedy fill (miles_cli/help.py); it must break exactly where textwrap does."""
    import random
    import textwrap

    from miles_cli import help as help_module

    texts: list[str] = []
    original = help_module.write_rows
    monkeypatch.setattr(help_module, "write_rows", lambda f, rows, col_max=32: (texts.extend(t for r in rows for t in r), original(f, rows, col_max)))
    _fast(["train", "--model-name", "qwen3-4b", "--help-all"], monkeypatch)  # every option's text, SGLang's too
    rng = random.Random(0)
    for _ in range(3000):  # runs of spaces, words longer than the line, leading and trailing spaces, tabs, newlines
        words = [rng.choice([" " * rng.randint(1, 3), "x" * rng.choice([1, 2, 5, 13, 40]), "a-b.c/d", "é", "\t", "\n"]) for _ in range(rng.randint(0, 12))]
        texts.append(rng.choice(["", " "]) + " ".join(words) + rng.choice(["", "  "]))
    assert len(texts) > 1500
    for text in texts:
        for width in (1, 7, 30, 46, 78):
            assert help_module.wrap_words(text, width) == textwrap.wrap(text, width, break_on_hyphens=False, break_long_words=False), (text, width)
