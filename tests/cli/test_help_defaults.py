"""Every default printed by `--help` is the value the resolved configuration really holds.

This is the bug class of upstream PR #2390 (help said one thing, validate_args did another). For every
command and every registered recipe, render `--help` without wrapping, read each option's
`[default: ...]`, and compare with the resolved recipe options and engine configuration. Derived
options print their rule; the rule text must be the declared one (tests/config/test_derived_rules.py
checks the rule itself against resolved configurations).
"""

from __future__ import annotations

import dataclasses
import re

import pytest

from miles.config.engine import option_specs
from miles.config.sglang import GROUPS as SGLANG_GROUPS
from miles.config.values import format_value
from miles_cli.api import recipe_specs
from miles_cli.run_commands import engine_specs_for, resolve_invocation
from recipes import RECIPES
from tests.cli.helpers import help_rows, invoke, shown_default, shown_derived

COMMANDS = ["full-train", "train", "eval"]


@pytest.mark.parametrize("recipe_name", sorted(RECIPES))
@pytest.mark.parametrize("command", COMMANDS)
def test_help_defaults_equal_resolved_values(command, recipe_name):
    recipe = RECIPES[recipe_name]
    result = invoke([command, "--model-name", recipe_name, "--help-all"])
    assert result.exit_code == 0, result.output
    rows = help_rows(result.output)

    inv = resolve_invocation(command, recipe, recipe.Options(), {}, [])
    expected: dict[str, str] = {}
    derived_text: dict[str, str] = {}
    offered = {s.name for s in recipe_specs(recipe, command)}  # eval offers only the recipe options it reads
    for f in dataclasses.fields(inv.options):
        if f.name not in offered:
            continue
        flag = "--" + f.name.replace("_", "-")
        expected[flag] = format_value(getattr(inv.options, f.name))
        if f.metadata.get("derived") is not None:
            derived_text[flag] = f.metadata["derived"].text
    for s in engine_specs_for(recipe, command):
        expected[s.flag] = format_value(inv.config.get(s.name))
        if s.derived is not None and inv.sources[s.name] == "derived":
            derived_text[s.flag] = s.derived.text

    # A panel whose options are all unavailable is one line in --help-all; --help-group shows it in full.
    text = " ".join(result.output.split())
    collapsed = [p for p in text.split("Not available in this build (")[1:]]
    for s in engine_specs_for(recipe, command):
        if s.flag not in rows:
            assert any(s.flag in p.split(". Details")[0] for p in collapsed), f"{s.flag} missing from `miles {command} --help-all`"
            group = s.panel.lower().replace(" ", "-")
            rows.update(help_rows(invoke([command, "--model-name", recipe_name, "--help-group", group]).output))
    checked = 0
    for flag, value in expected.items():
        assert flag in rows, f"{flag} missing from `miles {command} --help-all`"
        assert shown_default(rows[flag]) == value, f"{command} {recipe_name} {flag}: help {rows[flag]!r}, resolved {value!r}"
        checked += 1
    for flag, text in derived_text.items():
        assert shown_derived(rows[flag]) == text, f"{flag}: {rows[flag]!r}"
    assert checked > (20 if command == "eval" else 100)  # every option is covered, not a sample


def test_recipe_override_is_what_help_shows():
    """The tiny recipe turns --train-deterministic on; the other recipe leaves it off; help follows."""
    tiny = help_rows(invoke(["train", "--model-name", "tiny-qwen3", "--help"]).output)
    qwen = help_rows(invoke(["train", "--model-name", "qwen3-0.6b", "--help"]).output)
    assert shown_default(tiny["--train-deterministic"]) == "true"
    assert shown_default(qwen["--train-deterministic"]) == "false"
    assert "--deterministic-mode" not in tiny  # the recipe option is its only flag


def test_env_var_changes_the_default_help_shows(monkeypatch):
    monkeypatch.setenv("PROMETHEUS_PORT", "9333")
    monkeypatch.setenv("MILES_SCRIPT_SFT_STEPS", "7")
    rows = help_rows(invoke(["train", "--help-all"]).output)
    assert shown_default(rows["--prometheus-port"]) == "9333"
    assert shown_default(rows["--sft-steps"]) == "7"
    inv = resolve_invocation("train", RECIPES["tiny-qwen3"], RECIPES["tiny-qwen3"].Options(sft_steps=7), {}, [])
    assert inv.config.tracking.prometheus_port == 9333


def test_top_level_help_lists_the_commands():
    out = invoke(["--help"]).output
    for command in ["convert", "full-train", "train", "eval", "docker-build"]:
        assert re.search(rf"^  {command}  ", out, re.M), out


def test_convert_help_defaults_equal_the_options_dataclass():
    from miles.config.convert import ConvertOptions
    from miles.config.engine import specs_of

    rows = help_rows(invoke(["convert", "--help"]).output)
    defaults = ConvertOptions()
    specs = specs_of(ConvertOptions, "convert", "Convert")
    assert len(specs) >= 9
    for s in specs:
        if s.required:
            assert rows[s.flag].endswith("[required]"), (s.flag, rows[s.flag])
        else:
            assert shown_default(rows[s.flag]) == format_value(getattr(defaults, s.name)), s.flag
    assert rows["--save"].endswith("[required]")


def test_docker_build_help_defaults_equal_the_declarations():
    from miles.config.docker_build import DockerBuildOptions
    from miles.config.engine import specs_of

    rows = help_rows(invoke(["docker-build", "--help"]).output)
    specs = specs_of(DockerBuildOptions, "docker_build", "Build")
    assert [s.flag for s in specs if s.required] == ["--variant", "--image-tag"]
    for s in specs:
        if s.required:
            assert rows[s.flag].endswith("[required]"), (s.flag, rows[s.flag])
        else:
            assert shown_default(rows[s.flag]) == format_value(s.default), (s.flag, rows[s.flag])


@pytest.mark.parametrize("command, options_cls", [("generate", "DocsGenerateOptions"), ("check", "DocsCheckOptions")])
def test_docs_command_options_are_the_declared_fields(command, options_cls):
    """`miles docs generate|check` take exactly their dataclass's fields, with the declared defaults."""
    from miles.config import docs_options
    from miles.config.engine import specs_of

    specs = specs_of(getattr(docs_options, options_cls), "docs", "Options")
    rows = help_rows(invoke(["docs", command, "--help"]).output)
    assert set(rows) - {"--help"} == {s.flag for s in specs}
    for s in specs:
        assert shown_default(rows[s.flag]) == format_value(s.default), (s.flag, rows[s.flag])
