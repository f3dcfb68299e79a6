"""`miles_cli.api` resolves exactly what the `miles` program resolves, for the same recipe and option names.

The CLI side runs the real program (`miles <command> ... --dry-run`, a subprocess) and reads the
printed table; the Python side calls `api.resolve` with the same options as keyword arguments.

Run: pytest tests/cli/test_api.py
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest

from miles.errors import UserError
from miles_cli import api
from miles_cli.output import option_rows
from tests.cli.helpers import table_rows

CASES = [
    # (command, CLI arguments, the same as api.resolve keyword arguments)
    ("train", [], {}),
    (
        "train",
        ["--mode", "debug_minimal", "--run-id", "r1", "--lr", "1e-4", "--eval-prompt-data", "a", "x.jsonl",
         "--no-train-deterministic", "--extra-args", "--num-rollout 7 --rollout-temperature 0.5", "--", "--eps-clip", "0.3"],
        dict(mode="debug_minimal", run_id="r1", lr=1e-4, eval_prompt_data=["a", "x.jsonl"], train_deterministic=False,
             extra_args="--num-rollout 7 --rollout-temperature 0.5", args=["--eps-clip", "0.3"]),
    ),
    ("full-train", ["--model-name", "qwen3-0.6b", "--num-gpus-per-node", "2", "--colocate"],
     dict(recipe="qwen3-0.6b", num_gpus_per_node=2, colocate=True)),
    ("eval", ["--eval-prompt-data", "arith", "e.jsonl", "--eval-temperature", "0.7"],
     dict(eval_prompt_data=["arith", "e.jsonl"], eval_temperature=0.7)),
]


@pytest.mark.parametrize("command, argv, kwargs", CASES, ids=["defaults", "mixed", "other-recipe", "eval"])
def test_api_resolves_what_the_cli_resolves(command, argv, kwargs, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    env = {k: v for k, v in os.environ.items() if not k.startswith("MILES_SCRIPT_")}
    for k in [k for k in os.environ if k.startswith("MILES_SCRIPT_")]:
        monkeypatch.delenv(k)
    r = subprocess.run(
        [sys.executable, "-m", "miles_cli.main", command, "--dry-run", *argv],
        capture_output=True, text=True, timeout=120, env={**env, "COLUMNS": "400", "NO_COLOR": "1"},
    )
    # --dry-run prints the table, then runs the run's input checks; in this empty directory the
    # prepared model/data do not exist, which is the one error allowed here (exit 2, after the table).
    assert r.returncode == 0 or (r.returncode == 2 and "does not exist" in r.stderr), r.stderr
    cli = {flag: value for flag, (value, _) in table_rows(r.stdout).items()}
    kwargs = dict(kwargs)
    recipe = kwargs.pop("recipe", None)
    inv = api.resolve(recipe, command, **kwargs)
    python = {flag: value for _, flag, value, _ in option_rows(inv, sglang_defaults=False)}  # as the table: SGLang options at their default left out
    assert len(python) > (40 if command == "eval" else 120)  # an eval's table: only the options eval reads
    assert cli == python


def test_api_reads_miles_script_variables_like_the_cli(monkeypatch):
    monkeypatch.setenv("MILES_SCRIPT_MODE", "debug_minimal")
    assert api.resolve().config.data.num_rollout == 3
    assert api.resolve(mode="normal").config.data.num_rollout == 500  # the argument wins, as the command line does


def test_api_mistakes_are_the_cli_mistakes():
    with pytest.raises(UserError, match="rollout_batch_sise.*Did you mean rollout_batch_size"):
        api.resolve(rollout_batch_sise=3)
    with pytest.raises(UserError, match="set by the recipe option 'train_deterministic'"):
        api.resolve(deterministic_mode=False)
    with pytest.raises(UserError, match="--critic-lr configures the PPO critic, which only --advantage-estimator ppo trains"):
        api.resolve(critic_lr=1e-5)
    with pytest.raises(UserError, match="No such option --lr-typo in --extra-args"):
        api.resolve(extra_args="--lr-typo 1")
    with pytest.raises(UserError, match="'lr' is not an option of this command"):
        api.resolve(command="eval", lr=1e-3)
    with pytest.raises(UserError, match="'train_backend' is not an option of eval"):  # a recipe option only training reads
        api.resolve(command="eval", train_backend="fsdp")


def test_the_cli_is_a_layer_over_the_api():
    """The run commands call api.resolve_invocation: one resolution path, not two."""
    import inspect

    from miles_cli import run_commands

    source = inspect.getsource(run_commands.build_run_command)
    assert "resolve_invocation(" in source and "build_config(" not in source
    assert {f.name for f in dataclasses.fields(api.Invocation)} >= {"config", "options", "sources", "env"}
