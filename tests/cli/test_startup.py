"""What `miles --help` and `miles <command> --help` import and build (docs/benchmarks.md, "CLI start-up").

The top-level help lists commands from miles_cli/summaries.py and builds none of them; a command's
help builds that command only, and its options coerce values without pydantic (miles_cli/coerce.py),
whose plain path must give exactly what Typer's adapters give, errors included.
"""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest
import typer.main
from typer._click.exceptions import BadParameter
from typer._coercion import build_runtime_param

from miles_cli import coerce, summaries
from miles_cli.main import build_app

NEVER_FOR_TOP_HELP = ("miles.config.engine", "recipes", "miles_cli.run_commands", "miles_cli.docs_cmd", "miles.docker_images", "pydantic", "rich.console")


def _imported_by(argv: list[str], names: tuple[str, ...]) -> tuple[list[str], str]:
    """(those of `names` imported by `miles argv` in a fresh interpreter, its stdout)."""
    code = (
        "import sys\n"
        f"sys.argv = ['miles'] + {argv!r}\n"
        "from miles_cli.main import main\n"
        "try:\n    main()\nexcept SystemExit:\n    pass\n"
        f"print('IMPORTED=' + ','.join(m for m in {names!r} if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    line = next(x for x in out.stdout.splitlines() if x.startswith("IMPORTED="))
    return [m for m in line[len("IMPORTED="):].split(",") if m], out.stdout


def test_top_level_help_builds_no_command():
    imported, stdout = _imported_by(["--help"], NEVER_FOR_TOP_HELP)
    assert imported == []
    for name in ("convert", "full-train", "train", "eval", "docker-build"):
        assert f"  {name} " in stdout


def test_the_maintainers_docs_command_is_not_listed_and_still_runs():
    """`miles docs` (regenerate/check the docs) is for maintainers: off the user's first screen and
    out of completion, yet `miles docs ...` works as before (issue 28)."""
    top = subprocess.run([sys.executable, "-m", "miles_cli.main", "--help"], capture_output=True, text=True, timeout=120)
    assert top.returncode == 0 and "  docker-build " in top.stdout, top.stdout
    listed = [line.split()[0] for line in top.stdout.split("Commands:")[1].splitlines() if line.startswith("  ") and not line.startswith("   ")]
    assert listed == ["convert", "full-train", "train", "eval", "docker-build"]
    r = subprocess.run([sys.executable, "-m", "miles_cli.main", "docs", "--help"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "generate" in r.stdout and "check" in r.stdout, r.stdout + r.stderr


@pytest.mark.parametrize("argv", [["train", "--help"], ["train", "--lr", "1e-5", "--rollout-batch-size", "8", "--help"], ["eval", "--help-all"]])
def test_command_help_builds_only_that_command_without_pydantic(argv):
    others = ("pydantic", "miles_cli.convert", "miles_cli.docker_build", "miles_cli.docs_cmd")
    imported, stdout = _imported_by(argv, others)
    assert imported == []
    assert "--lr" in stdout


def test_docker_build_dry_run_imports_no_recipe_or_pydantic():
    imported, stdout = _imported_by(["docker-build", "--variant", "cu13", "--image-tag", "latest", "--dry-run"], ("pydantic", "recipes"))
    assert imported == []
    assert "buildx" in stdout


def test_listing_summaries_are_the_built_commands_own():
    """The top-level listing (from summaries.py, nothing built) says what each built command says."""
    group = typer.main.get_command(build_app(["--help"]))
    listed = {name: group.commands.summary_of(name).get_short_help_str(10_000) for name in group.list_commands(None)}
    assert list(listed) == ["convert", "full-train", "train", "eval", "docker-build", "docs"]
    assert listed["train"] == summaries.RUN["train"]
    built = {name: group.commands[name].get_short_help_str(10_000) for name in listed}
    assert listed == built


def test_a_command_is_built_when_first_used_and_only_it():
    group = typer.main.get_command(build_app(["train", "--help"]))
    pending = lambda: [n for n in group.commands if dict.__getitem__(group.commands, n).__class__.__name__ == "Pending"]  # noqa: E731
    assert len(pending()) == 6
    assert group.get_command(None, "train").name == "train"
    assert sorted(pending()) == ["convert", "docker-build", "docs", "eval", "full-train"]
    assert group.get_command(None, "nope") is None


def test_brief_help_panels_name_the_run_panel():
    from miles_cli.help import BRIEF_PANELS
    from miles_cli.options import RUN_PANEL

    assert RUN_PANEL in BRIEF_PANELS


# --- plain coercion equals Typer's adapters ---------------------------------------------------------

INPUTS: dict[str, list[Any]] = {
    "str": ["abc", "", " a b ", 600, 1.5, True],
    "int": ["3", "-3", "+3", "0", "007", "3.0", "3.5", "1_000", " 4 ", "abc", "", "99999999999999999999", 5, 2.0, True],
    "float": ["1e-5", "1E3", "-0.5", ".5", "5.", "3", "inf", "nan", "-Infinity", "1_0.5", " 2 ", "abc", "", 3, 0.25, True],
    "bool": ["true", "false", "1", "0", "yes", "no", "on", "off", "t", "f", "y", "n", "", "True", "FALSE", " yes ", "maybe", "2", True, False, 1, 0],
}


def _outcome(runtime: Any, value: Any, param: Any) -> tuple[str, Any]:
    try:
        out = runtime._coerce_value(value, param=param, ctx=None)
    except BadParameter as e:
        return "error", e.message
    return type(out).__name__, repr(out)


def _train_params() -> list[Any]:
    group = typer.main.get_command(build_app(["train", "--help"]))
    return list(group.commands["train"].params)


def test_every_train_option_coerces_like_typer():
    """For every option of `miles train` (several hundred, all of SGLang's) and inputs of its type,
    the plain path and Typer's pydantic adapter give the same value and type, or the same error."""
    params = _train_params()
    plain = [p for p in params if isinstance(getattr(p, "_runtime_param", None), coerce.PlainRuntimeParam)]
    assert len(plain) == len([p for p in params if hasattr(p, "type_descriptor")]) > 300
    seen_kinds: set[str] = set()
    for p in plain:
        ann = p.type_descriptor.annotation
        item = ann.__args__[0] if getattr(ann, "__origin__", None) is list else ann
        if getattr(item, "__origin__", None) is not None:  # Literal
            choices = list(item.__args__)
            values = [choices[0], choices[-1], choices[0].upper(), "not-a-choice", ""]
            kind = "choice"
        else:
            kind = item.__name__
            values = INPUTS[kind]
        if ann is not item:
            values = [tuple(values[:3]), list(values[-2:]), values[0]]
            kind = f"list[{kind}]"
        if kind in seen_kinds and kind != "choice":
            continue  # one option per scalar kind is enough; every choice set is checked
        seen_kinds.add(kind)
        typer_runtime = build_runtime_param(p.type_descriptor)
        for v in values:
            assert _outcome(p._runtime_param, v, p) == _outcome(typer_runtime, v, p), (p.name, ann, v)
    assert {"str", "int", "float", "bool", "choice", "list[str]", "list[int]"} <= seen_kinds


@pytest.mark.parametrize(
    "words, cword, expected",
    [("miles tr", "1", "train"), ("miles d", "1", "docker-build"), ("miles train --rollout-batch", "2", "--rollout-batch-size")],
)
def test_completion_of_lazy_commands_and_their_options(words, cword, expected):
    """Completing a command name lists the commands without building them; completing an option builds that command."""
    env = {**__import__("os").environ, "_MILES_COMPLETE": "complete_bash", "COMP_WORDS": words, "COMP_CWORD": cword}
    out = subprocess.run([sys.executable, "-m", "miles_cli.main"], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == expected


def test_version_prints_the_installed_version_without_the_heavy_stack():
    import os
    import subprocess
    import sys
    from importlib.metadata import version
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    r = subprocess.run([sys.executable, "-X", "importtime", "-m", "miles_cli.main", "--version"], capture_output=True, text=True,
                       timeout=60, env={**os.environ, "PYTHONPATH": str(root)})
    assert r.returncode == 0 and r.stdout.strip() == f"miles {version('miles')}", r.stdout + r.stderr[-500:]
    imported = {line.rsplit("|", 1)[-1].strip() for line in r.stderr.splitlines() if "|" in line}
    assert not imported & {"torch", "ray", "transformers"}
