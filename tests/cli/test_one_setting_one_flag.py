"""One setting, one flag; one parser; help that agrees with the run. Through the real `miles` program.

Each example of issue 10 is run as a user runs it (a `miles` subprocess in an empty directory), plus
a structural test that enumerates every pair of options that could write the same engine field.

Run: pytest tests/cli/test_one_setting_one_flag.py
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from miles.config.engine import option_specs
from miles_cli.api import COMMANDS, engine_specs_for, linked_options, recipe_specs, resolve_invocation
from recipes import RECIPES
from tests.cli.helpers import help_rows, shown_default, table_rows, dry_run_ok

MILES = [sys.executable, "-m", "miles_cli.main"]


def miles(*argv: str, env: dict[str, str] | None = None, columns: int = 400, cwd=None) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if not k.startswith("MILES_SCRIPT_")}
    full_env = {**base, "COLUMNS": str(columns), "NO_COLOR": "1", "TERM": "dumb", **(env or {})}
    return subprocess.run([*MILES, *argv], capture_output=True, text=True, timeout=120, env=full_env, cwd=cwd)


@pytest.fixture(autouse=True)
def _empty_cwd(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # relative defaults (runs/...) never meet a real run


# --- one setting, one flag ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv, names",
    [
        (["--train-deterministic", "--no-deterministic-mode"], ["--no-deterministic-mode", "--train-deterministic"]),
        (["--hardware", "cpu", "--device", "cuda"], ["--device", "--hardware"]),
        (["--num-gpus-per-node", "2", "--actor-num-gpus-per-node", "1"], ["--actor-num-gpus-per-node", "--num-gpus-per-node"]),
        (["--num-nodes", "1", "--actor-num-nodes", "1"], ["--actor-num-nodes", "--num-nodes"]),
        (["--extra-args", "--deterministic-mode"], ["--deterministic-mode", "--train-deterministic"]),
        (["--", "--device", "cpu"], ["--device", "--hardware"]),
    ],
    ids=lambda x: " ".join(x) if isinstance(x, list) else None,
)
def test_a_second_flag_for_one_setting_exits_2_naming_both(argv, names):
    r = miles("train", "--dry-run", *argv)
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stderr.startswith("Error: ") and r.stderr.count("\n") == 1, r.stderr
    for name in names:
        assert name in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and r.stdout == ""  # nothing printed before the error


@pytest.mark.parametrize("recipe_name", sorted(RECIPES))
@pytest.mark.parametrize("command", COMMANDS)
def test_no_two_flags_write_the_same_field(command, recipe_name):
    """Declared: every flag of the command writes one engine field, and no field has two flags."""
    recipe = RECIPES[recipe_name]
    writers: dict[str, list[str]] = {}
    for s in engine_specs_for(recipe, command):
        writers.setdefault(s.name, []).append(s.flag)
    for s in recipe_specs(recipe):
        if s.engine:
            writers.setdefault(s.engine, []).append(s.flag)
    assert {field: flags for field, flags in writers.items() if len(flags) > 1} == {}
    assert set(linked_options(recipe)) >= {"deterministic_mode", "device", "actor_num_nodes", "actor_num_gpus_per_node", "train_backend"}


def _two_values(s):
    if s.kind in ("bool", "tristate"):
        return [True, False]
    if s.choices:
        return list(s.choices[:2])
    if s.base_type is int:
        return [2, 3]
    if s.base_type is str:
        return ["aaa", "bbb"]
    return None


@pytest.mark.parametrize("recipe_name", sorted(RECIPES))
def test_no_recipe_option_is_copied_into_an_engine_flag(recipe_name):
    """Observed: changing a recipe option never moves an engine flag in lock-step with it (a hand-made
    copy in plan(), which a user could contradict with the engine flag)."""
    recipe = RECIPES[recipe_name]
    engine = {s.name: s for s in engine_specs_for(recipe, "train")}
    checked = 0
    for s in recipe_specs(recipe):
        values = _two_values(s)
        if values is None or len(values) < 2 or s.name in ("model_name", "extra_args"):
            continue
        invs = [resolve_invocation("train", recipe, recipe.Options(**{s.name: v}), {}, [], check=False) for v in values]
        for name in engine:
            a, b = invs[0].config.get(name), invs[1].config.get(name)
            # A derived default (the MLflow run name defaults to the run id) is a default, not a copy.
            by_rule = invs[0].sources[name] == "derived"
            copies = a != b and a == values[0] and b == values[1] and not by_rule
            assert not copies, f"{s.flag} is copied into {engine[name].flag} by {recipe_name}'s plan(); declare engine= instead"
        checked += 1
    assert checked >= 6


def test_a_copy_in_plan_would_be_caught(monkeypatch):
    """The check above is not vacuous: a plan() that copies --num-gpus-per-node into an engine flag fails it."""
    recipe = RECIPES["tiny-qwen3"]
    original = recipe.plan

    def copying_plan(o):
        plan = original(o)
        plan.engine["rollout_max_batch_size"] = o.num_gpus_per_node  # a hand-made copy
        return plan

    monkeypatch.setattr(recipe, "plan", copying_plan)
    with pytest.raises(AssertionError, match="num-gpus-per-node"):
        test_no_recipe_option_is_copied_into_an_engine_flag("tiny-qwen3")


def test_engine_checks_name_the_flag_the_user_has():
    r = miles("train", "--num-nodes", "2")  # checked when the run starts (--dry-run plans several nodes)
    assert r.returncode == 2 and r.stderr.startswith("Error: --num-nodes > 1 needs a multi-node Ray cluster"), r.stderr
    r = miles("train", "--dry-run", "--num-gpus-per-node", "3")
    assert "(--num-nodes × --num-gpus-per-node = 3)" in r.stderr and "actor" not in r.stderr, r.stderr


@pytest.mark.parametrize("recipe_name", sorted(RECIPES))
def test_deterministic_mode_gets_its_environment_in_every_recipe(recipe_name):
    r = miles("train", "--dry-run", "--model-name", recipe_name, "--train-deterministic")
    assert dry_run_ok(r), r.stderr
    env_line = next(line for line in r.stdout.splitlines() if line.startswith("Environment:"))
    for pair in ("CUBLAS_WORKSPACE_CONFIG=:4096:8", "NCCL_ALGO=Ring", "NVTE_ALLOW_NONDETERMINISTIC_ALGO=0"):
        assert pair in env_line
    r = miles("full-train", "--dry-run", "--model-name", recipe_name, "--no-train-deterministic")
    assert "CUBLAS_WORKSPACE_CONFIG" not in r.stdout
    help_text = " ".join(miles("train", "--model-name", recipe_name, "--help").stdout.split())
    assert "When on, the run's processes get CUBLAS_WORKSPACE_CONFIG=:4096:8, NCCL_ALGO=Ring, NVTE_ALLOW_NONDETERMINISTIC_ALGO=0." in help_text


# --- help shows what this invocation will use --------------------------------------------------


def test_help_follows_mode_from_the_environment_and_run_id_from_the_command_line():
    rows = help_rows(miles("train", "--help", env={"MILES_SCRIPT_MODE": "debug_minimal"}).stdout)
    assert shown_default(rows["--num-rollout"]) == "3"
    rows = help_rows(miles("train", "--run-id", "foo", "--help").stdout)
    assert shown_default(rows["--save"]) == "runs/foo/checkpoints"
    assert shown_default(rows["--load"]) == "runs/foo/checkpoints"
    rows = help_rows(miles("train", "--rollout-temperature", "0.5", "--help-all").stdout)
    assert shown_default(rows["--rollout-temperature"]) == "0.5"


@pytest.mark.parametrize("recipe_name", sorted(RECIPES))
@pytest.mark.parametrize("mode", ["normal", "debug_minimal"])
@pytest.mark.parametrize("how", ["flag", "env"])
def test_help_and_dry_run_table_agree(recipe_name, mode, how):
    """Every option: the value `--help-all` shows is the value the dry-run table resolves."""
    if how == "flag":
        argv, env = ["--model-name", recipe_name, "--mode", mode, "--run-id", f"r-{mode}"], {}
    else:
        argv, env = [], {"MILES_SCRIPT_MODEL_NAME": recipe_name, "MILES_SCRIPT_MODE": mode, "MILES_SCRIPT_RUN_ID": f"r-{mode}"}
    shown = help_rows(miles("train", *argv, "--help-all", env=env).stdout)
    table = table_rows(miles("train", *argv, "--dry-run", env=env).stdout)
    assert len(table) > 120
    compared = 0
    for flag, (value, _source) in table.items():
        if flag not in shown:  # the options of a panel not built yet are one line in --help-all
            continue
        assert shown_default(shown[flag]) == value, f"{flag}: help {shown[flag]!r}, run {value!r}"
        compared += 1
    assert compared > 110
    assert table["--mode"][0] == mode and table["--save"][0] == f"runs/r-{mode}/checkpoints"


def test_tracking_defaults_are_values_not_none():
    table = table_rows(miles("train", "--dry-run", "--run-id", "exp1").stdout)
    assert table["--mlflow-run-name"][0] == "exp1"
    assert table["--mlflow-tracking-uri"][0] == "sqlite:///runs/exp1/mlflow.db"
    assert table["--tensorboard-dir"][0] == "runs/exp1/tensorboard"
    assert table["--wandb-project"][0] == "miles" and table["--wandb-group"][0] == "exp1"
    assert table["--wandb-dir"][0] == "runs/exp1/wandb" and table["--prometheus-run-name"][0] == "exp1"


# --- what this build cannot run ----------------------------------------------------------------


@pytest.mark.parametrize(
    "flag, value",
    # --rollout-backend sglang is no longer here: issue-15 makes it resolve (--dry-run plans the servers) and
    # the run refuses it where it cannot launch (tests/sglang_backend/test_sglang_options.py, ..._without_gpus_exits_2).
    # Every choice some option declares unavailable in this build (none since ppo got its critic,
    # issue 25; the mechanism stays for the next backend that lands in pieces).
    [(s.flag, c) for s in option_specs() for c in s.unavailable],
)
def test_unavailable_choices_are_declared_shown_and_rejected(flag, value):
    rows = help_rows(miles("train", "--help-all").stdout)
    assert f"Not in this build: {value}, because" in rows[flag]
    assert value not in rows[flag].split("One of: ")[1].split(".")[0].split(", ")
    r = miles("train", "--dry-run", flag, value)
    assert r.returncode == 2 and f"{flag} {value} cannot run in this build" in r.stderr, r.stderr


# --- one parser ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv",
    [
        ["--eval-prompt-data", "a", "x.jsonl", "b", "y.jsonl"],
        ["--eval-prompt-data", "a", "--eval-prompt-data", "x.jsonl", "--eval-prompt-data", "b", "--eval-prompt-data", "y.jsonl"],
        ["--extra-args", "--eval-prompt-data a x.jsonl b y.jsonl"],
        ["--extra-args", "--eval-prompt-data a --eval-prompt-data x.jsonl --eval-prompt-data b y.jsonl"],
        ["--", "--eval-prompt-data", "a", "x.jsonl", "b", "y.jsonl"],
    ],
)
def test_list_options_mean_the_same_in_all_three_places(argv):
    r = miles("train", "--dry-run", *argv)
    assert dry_run_ok(r), r.stderr
    assert table_rows(r.stdout)["--eval-prompt-data"][0] == "a x.jsonl b y.jsonl"


@pytest.mark.parametrize("argv", [["--offload-train=false"], ["--extra-args", "--offload-train=false"], ["--", "--offload-train=false"]])
def test_the_same_text_is_refused_the_same_way_everywhere(argv):
    r = miles("train", "--dry-run", *argv)
    assert r.returncode == 2
    assert "--offload-train" in r.stderr and "does not take a value; write --offload-train or --no-offload-train" in r.stderr


def test_every_usage_error_has_one_style():
    for argv in (["train", "--advantage-estimator", "dpo"], ["train", "--rollout-batch-size", "many"], ["train", "--no-such"],
                 ["convert", "--from", "hf"], ["docker-build", "--variant", "nope", "--image-tag", "dev"]):
        r = miles(*argv)
        assert r.returncode == 2, (argv, r.stderr)
        assert r.stderr.startswith("Error: ") and r.stderr.count("\n") == 1, (argv, r.stderr)
        for leak in ("╭", "Usage:", "Value error", "Input should", "Traceback"):
            assert leak not in r.stderr, (argv, r.stderr)
    assert "'dpo' is not one of grpo, gspo, reinforce_plus_plus, reinforce_plus_plus_baseline" in miles("train", "--advantage-estimator", "dpo").stderr


def test_eval_offers_exactly_what_eval_reads():
    rows = help_rows(miles("eval", "--help-all").stdout)
    recipe = RECIPES["tiny-qwen3"]
    engine = {s.flag for s in option_specs() if s.in_eval and s.name not in linked_options(recipe)}
    expected = engine | {s.flag for s in recipe_specs(recipe, "eval")} | {"--dry-run", "--checkpoint", "--help-all", "--help-group", "--help"}
    assert set(rows) == expected
    r = miles("eval", "--lr", "1e-4")
    assert r.returncode == 2 and "--lr: not an option of `miles eval`" in r.stderr


@pytest.mark.parametrize("recipe_name", ["tiny-qwen3", "qwen3-4b"])
def test_eval_help_starts_with_the_checkpoint_and_has_no_training_options(recipe_name):
    """Issue 28: `miles eval --help` listed --train-backend and --sft-steps, with --checkpoint last."""
    out = miles("eval", "--model-name", recipe_name, "--help").stdout
    rows = list(help_rows(out))
    assert rows[0] == "--checkpoint", rows[:5]
    for training in ("--train-backend", "--sft-steps", "--num-nodes", "--num-gpus-per-node", "--train-deterministic", "--prompt-file"):
        assert training not in rows and training not in miles("eval", "--model-name", recipe_name, "--help-all").stdout
    assert {"--model-name", "--run-id", "--hardware", "--data-dir", "--extra-args"} <= set(rows)
    assert ("--prepare-seed" in rows) == (recipe_name == "tiny-qwen3")  # names the prepared model and data eval reads
    for argv in (["--train-backend", "fsdp"], ["--no-train-deterministic"], ["--extra-args", "--lr 1e-5"], ["--actor-num-nodes", "2"]):
        r = miles("eval", "--model-name", recipe_name, *argv)
        assert r.returncode == 2 and "not an option of `miles eval` (only training reads it)" in r.stderr, (argv, r.stderr)


def test_eval_is_not_stopped_by_the_trainers_layout(tmp_path):
    """An eval builds no trainer: qwen3-4b's megatron kernels (TransformerEngine) do not stop an eval on
    the CPU, which used to exit 2 naming --transformer-impl, an option eval does not offer."""
    r = miles("eval", "--model-name", "qwen3-4b", "--hardware", "cpu", "--dry-run", cwd=tmp_path)
    assert "--transformer-impl" not in r.stderr, r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("Error: --hf-checkpoint runs/models/Qwen3-4B does not exist"), r.stderr


def test_convert_save_is_required():
    assert help_rows(miles("convert", "--help").stdout)["--save"].endswith("[required]")
    r = miles("convert", "--from", "hf", "--hf-checkpoint", "x")
    assert r.returncode == 2 and "--save is required" in r.stderr


# --- help a person can read ----------------------------------------------------------------------


@pytest.mark.parametrize("which", ["--help", "--help-all"])
def test_help_fits_80_columns_and_cuts_nothing(which):
    out = miles("train", which, columns=80).stdout
    for line in out.splitlines():
        assert len(line) <= 80 or len(line.split()) == 1, line  # only a single word longer than a line may exceed it
    assert "…" not in out
    if which == "--help-all":
        joined = " ".join(out.split())
        wide = help_rows(miles("train", which, columns=400).stdout)
        narrow = help_rows(out)
        assert set(narrow) == set(wide) and len(narrow) > 120
        for flag, text in wide.items():
            assert text == narrow[flag], flag  # same words: nothing cut or split, only wrapped
            assert flag in joined


def test_short_help_is_short_and_says_how_to_see_everything():
    short = miles("train", "--help", columns=100).stdout
    everything = miles("train", "--help-all", columns=100).stdout
    assert len(short.splitlines()) < len(everything.splitlines()) / 2
    assert "`miles train --help-all`" in " ".join(short.split())
    rollout = help_rows(miles("train", "--help-group", "rollout").stdout)
    assert "--rollout-temperature" in rollout and "--lr" not in rollout
    ft = " ".join(miles("train", "--help-all").stdout.split())
    assert "--use-fault-tolerance" in ft and "--rollout-health-check-interval" in ft


def test_completion_is_offered():
    out = miles("--help").stdout
    assert "--install-completion" in out and "--show-completion" in out


def test_dry_run_prints_every_option_and_a_start_only_what_differs():
    full = table_rows(miles("train", "--dry-run", "--lr", "1e-4").stdout)
    assert len(full) > 120 and full["--lr"] == ("0.0001", "command line")
    r = miles("train", "--lr", "1e-4", "--hf-checkpoint", "no/such/model")
    assert r.returncode == 2
    assert "--lr 0.0001" in r.stdout and "--rollout-seed" not in r.stdout  # only what differs
    assert len(r.stdout.splitlines()) < 10
    assert r.stderr.startswith("Error: --hf-checkpoint no/such/model does not exist")


def test_docs_check_fails_on_a_missing_directory():
    r = miles("docs", "check", "--docs-dir", "/nonexistent")
    assert r.returncode == 2 and "--docs-dir /nonexistent is not a directory" in r.stderr
    assert "passed" not in r.stdout + r.stderr
