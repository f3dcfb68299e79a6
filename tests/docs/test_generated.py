"""The generated reference is fresh, complete (every flag of every command) and says what --help says.

Run: pytest tests/docs/test_generated.py
"""

from __future__ import annotations


import re

import pytest
from typer.testing import CliRunner

from miles.docs import markdown
from miles.docs.cli_reference import flag_anchor, render_cli
from miles.docs.generate import FILES, expected, stale
from miles_cli.main import build_app


def test_generated_files_and_blocks_are_fresh(root, model):
    assert [str(p.relative_to(root)) for p in stale(root, model)] == [], "run `miles docs generate`"


def test_every_flag_of_every_command_is_in_the_reference(root, model):
    text = (root / "docs/reference/cli.md").read_text()
    anchors = markdown.anchors(markdown.parse(text))
    missing = []
    for name, cmd in model.commands.items():
        assert f"`miles {name}`" in text, name
        for fd in cmd.flags:
            if flag_anchor(name, fd.flag) not in anchors:
                missing.append(f"{name} {fd.flag}")
            missing += [f"{name} {f}" for f in fd.flags if f"`{f}`" not in text]
    for recipe, flags in model.recipe_flags.items():
        missing += [f"{recipe} {f}" for f in flags if f"`{f}`" not in text]
    assert missing == []
    assert len({f for c in model.commands.values() for fd in c.flags for f in fd.flags}) > 150  # walked the real app


def _help_defaults(argv: list[str]) -> dict[str, str]:
    """{flag: the value `[default: ...]` states} read from the rendered `miles ... --help-all`."""
    from tests.cli.helpers import help_rows, shown_default

    out = CliRunner().invoke(build_app(argv), argv, env={"COLUMNS": "4000", "NO_COLOR": "1"}).output
    return {flag: shown_default(text) for flag, text in help_rows(out).items() if shown_default(text) is not None}


@pytest.mark.parametrize("command", ["train", "eval", "convert", "docker-build"])
def test_reference_defaults_are_the_ones_help_prints(model, command):
    shown = _help_defaults([command, "--help-all" if command in ("train", "eval") else "--help"])
    assert len(shown) >= 2
    for flag, default in shown.items():
        fd = model.commands[command].flag(flag)
        assert fd is not None, flag
        assert default in (fd.default, fd.derived_value), flag


def _resolved_defaults(command: str) -> dict[str, str]:
    """{flag: the value the program really uses when the flag is not given}, written as help writes
    values: for train/eval the resolved configuration of the default recipe (recipe options, then the
    engine configuration after resolve()); for convert the ConvertOptions defaults; for docker-build
    the parameters' defaults. Options whose default is a derived rule are left out (their rule text is
    checked against the declaration, and the rule against resolved configs, in tests/config)."""
    import dataclasses
    import inspect

    from miles.config.convert import ConvertOptions
    from miles.config.fields import flag_name
    from miles.config.values import format_value

    if command == "convert":
        opts = ConvertOptions()
        return {flag_name(f): format_value(getattr(opts, f.name)) for f in dataclasses.fields(opts)}
    if command == "docker-build":
        from miles_cli.docker_build import docker_build

        params = inspect.signature(docker_build).parameters.values()
        return {"--" + p.name.replace("_", "-"): p.default for p in params if p.default is not inspect.Parameter.empty}
    from miles_cli.api import engine_specs_for, resolve_invocation
    from recipes import RECIPES

    recipe = RECIPES["tiny-qwen3"]
    inv = resolve_invocation(command, recipe, recipe.Options(), {}, [])
    out = {}
    for f in dataclasses.fields(inv.options):
        if f.metadata.get("derived") is None:
            out[flag_name(f)] = format_value(getattr(inv.options, f.name))
    for s in engine_specs_for(recipe, command):
        if s.flag not in out and (s.derived is None or s.name in inv.plan.engine):
            out[s.flag] = format_value(inv.config.get(s.name))
    return out


@pytest.mark.parametrize("command", ["train", "eval", "convert", "docker-build"])
def test_reference_defaults_are_the_values_the_program_uses(model, command):
    """What docs/reference/cli.md states as each default equals what the program resolves when the flag
    is absent (not what --help prints: the reference is generated from the same help, so that would
    compare a string with itself)."""
    resolved = _resolved_defaults(command)
    checked = 0
    for fd in model.commands[command].flags:
        if fd.flag not in resolved or fd.derived is not None or getattr(fd, "required", False):
            continue
        if command == "docker-build":  # its parameters are plain Python defaults (bools show as --no-x)
            assert fd.default_value == resolved[fd.flag], fd.flag
        else:
            assert fd.default == resolved[fd.flag], f"{command} {fd.flag}: reference {fd.default!r}, resolved {resolved[fd.flag]!r}"
        checked += 1
    assert checked >= {"train": 100, "eval": 20, "convert": 8, "docker-build": 3}[command]


def test_reference_rows_state_type_default_choices_rule_env_and_unsupported(model):
    text = render_cli(model)
    row = lambda flag: next(ln for ln in text.splitlines() if f'id="run-{flag}"' in ln)  # noqa: E731
    assert "| choice | `grpo` |" in row("advantage-estimator") and "`gspo`" in row("advantage-estimator")
    assert "| bool | derived |" in row("offload-train") and "Derived default: true under --colocate" in row("offload-train")
    assert "| int | `9090` |" in row("prometheus-port") and "Env: `PROMETHEUS_PORT`." in row("prometheus-port")
    assert "**Not available in this build:**" in row("eval-num-gpus")
    assert "Env: `MILES_SCRIPT_MODEL_NAME`." in row("model-name")
    assert "| int | `536870912` |" in row("update-weight-buffer-size")  # the upstream audit found 1 GB here


def test_recipe_sections_list_the_defaults_each_recipe_changes(model):
    text = render_cli(model)
    tiny = text.split("{#recipe-tiny-qwen3}")[1].split("### ")[0]
    from recipes import tiny_qwen3

    batch = tiny_qwen3.plan(tiny_qwen3.Options().resolve()).engine["rollout_batch_size"]
    assert f"| `--rollout-batch-size` | `None` | `{batch}` |" in tiny
    qwen = text.split("{#recipe-qwen3-0-6b}")[1]
    assert "| `--rollout-max-response-len` | `1024` | `8192` |" in qwen
    assert 'id="run-prompt-file"' in qwen  # an option only this recipe has gets its own row


def test_generate_writes_what_the_check_expects(tmp_path, root, model):
    # Regenerating into a copy of a page with a stale block restores the block exactly.
    page = tmp_path / "p.md"
    page.write_text("x\n<!-- BEGIN GENERATED: argument-groups -->\nold\n<!-- END GENERATED: argument-groups -->\ny\n")
    contents, _ = expected(root, model, docs_dir=tmp_path)
    new = contents[page]
    assert "\nold\n" not in new and "| [Cluster](reference/cli.md#run-cluster)" in new and new.endswith("y\n")  # (flags such as --sglang-router-cache-threshold contain "old")
    assert set(FILES) == {"docs/reference/cli.md", "docs/reference/recipes.md", "docs/reference/env-vars.md", "docs/reference/hooks.md"}
