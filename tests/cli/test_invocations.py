"""Bad invocations exit 2 with one sentence naming the option; engine values layer in the documented order."""

from __future__ import annotations

import subprocess
import sys

import pytest

from miles_cli.run_commands import resolve_invocation
from recipes import RECIPES
from tests.cli.helpers import error_text, invoke, dry_run_ok

TINY = RECIPES["tiny-qwen3"]

BAD = [
    (["train", "--rollout-batch-sise", "3"], "--rollout-batch-sise"),
    (["train", "--rollout-batch-size", "many"], "--rollout-batch-size"),
    (["train", "--advantage-estimator", "dpo"], "--advantage-estimator"),
    (["train", "--mode", "fast"], "--mode"),
    (["train", "--extra-args", "--lr-typo 1"], "--lr-typo"),
    (["train", "--extra-args", "--lr"], "--lr"),
    (["train", "--tensor-model-parallel-size", "2"], "--tensor-model-parallel-size"),
    (["train", "--train-backend", "megatron", "--transformer-impl", "transformer_engine"], "--transformer-impl"),
    (["train", "--train-backend", "megatron", "--fp8-format", "hybrid"], "--fp8-format"),
    (["train", "--train-backend", "megatron", "--attention-backend", "flash"], "--attention-backend"),
    (["train", "--train-backend", "megatron", "--pipeline-model-parallel-size", "2"], "--tensor-model-parallel-size"),
    (["train", "--train-backend", "megatron", "--num-gpus-per-node", "3", "--tensor-model-parallel-size", "2"],
     "--tensor-model-parallel-size"),
    (["train", "--train-backend", "megatron", "--sequence-parallel"], "--sequence-parallel"),
    (["train", "--train-backend", "megatron", "--num-gpus-per-node", "2", "--tensor-model-parallel-size", "2",
      "--sequence-parallel"], "--sequence-parallel"),  # needs TE/Apex norms: not on CPU
    (["train", "--use-fault-tolerance"], "--use-fault-tolerance"),
    (["train", "--rollout-num-gpus", "2", "--rollout-num-gpus-per-engine", "2"], "--rollout-num-gpus-per-engine"),
    (["train", "--sglang-router-policy", "fastest"], "--sglang-router-policy"),
    (["train", "--eps-clip-c", "0.5"], "--eps-clip-c"),
    (["train", "--num-epoch", "0"], "--num-epoch"),
    (["train", "--num-critic-only-steps", "2"], "--num-critic-only-steps"),
    (["train", "--hf-checkpoint", "/no/such/model"], "--hf-checkpoint"),
    (["train", "stray"], "stray"),
    (["eval", "--eval-prompt-data", "only-name"], "--eval-prompt-data"),
    (["convert", "--from", "hf", "--to", "hf", "--save", "x"], "--to"),
    (["convert", "--from", "hf", "--save", "x"], "--hf-checkpoint"),
    (["docker-build", "--variant", "cu13", "--image-tag", "custom"], "--custom-tag"),
]


@pytest.mark.parametrize("argv, named", BAD, ids=lambda x: " ".join(x) if isinstance(x, list) else None)
def test_bad_invocation_exits_2_naming_the_option(argv, named):
    result = invoke(argv)
    assert result.exit_code == 2, result.output
    assert named in error_text(result.output), result.output[-1500:]
    assert "Traceback" not in result.output


def test_unknown_recipe_exits_2_listing_recipes():
    r = subprocess.run([sys.executable, "-m", "miles_cli.main", "train", "--model-name", "gpt-17"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert "--model-name 'gpt-17' is not a recipe; choose one of: tiny-qwen3" in r.stderr
    assert "Traceback" not in r.stderr


def _miles(args: list[str], cwd) -> subprocess.CompletedProcess:
    """The real program, as a user runs it: its own sys.argv, in an empty directory."""
    return subprocess.run([sys.executable, "-m", "miles_cli.main", *args], capture_output=True, text=True, timeout=120, cwd=cwd)


def test_arguments_after_double_dash_reach_the_engine(tmp_path):
    """`--` passthrough through the real program (in-process runners see pytest's sys.argv, not ours)."""
    r = _miles(["train", "--dry-run", "--", "--lr", "2e-4", "--num-rollout", "7"], tmp_path)
    assert dry_run_ok(r), r.stderr[-2000:]
    def row(flag: str) -> str:  # a table row, or at narrow widths an `  --flag value  (source)` line
        return next(ln for ln in r.stdout.splitlines() if ln.lstrip("│ ").startswith(flag + " "))

    lr_row = row("--lr")
    assert "0.0002" in lr_row and "after --" in lr_row, lr_row
    assert "after --" in row("--num-rollout")


def test_a_bad_value_after_double_dash_is_judged_as_an_engine_value(tmp_path):
    # 7 does not divide the recipe's rollout: resolve() rejects it, naming the option; it is not taken
    # for a stray argument (which is what an in-process runner reading pytest's argv would report).
    r = _miles(["train", "--dry-run", "--", "--global-batch-size", "7"], tmp_path)
    assert r.returncode == 2, r.stdout[-2000:]
    assert "--global-batch-size" in r.stderr + r.stdout and "Unexpected argument" not in r.stderr + r.stdout
    assert "Traceback" not in r.stderr
    stray = _miles(["train", "--dry-run", "--global-batch-size-typo"], tmp_path)
    assert stray.returncode == 2


def test_unknown_flag_suggests_the_closest():
    out = invoke(["train", "--extra-args", "--rollout-batch-sise 3"]).output
    assert "Did you mean --rollout-batch-size" in out


def test_layers_later_wins():
    recipe = TINY.plan(TINY.Options().resolve()).engine
    # Twice the recipe's prompts per step: the derived optimizer-step count doubles with it.
    batch = 2 * recipe["rollout_batch_size"]
    steps = batch * recipe["n_samples_per_prompt"] // recipe["global_batch_size"]
    assert steps >= 2
    options = TINY.Options(extra_args="--lr 2e-4 --num-rollout 5")
    inv = resolve_invocation("train", TINY, options, {"lr": 1e-4, "rollout_batch_size": batch}, ["--num-rollout", "7"])
    assert inv.config.optimizer.lr == 2e-4 and inv.sources["lr"] == "--extra-args"
    assert inv.config.data.num_rollout == 7 and inv.sources["num_rollout"] == "after --"
    assert inv.config.data.rollout_batch_size == batch and inv.sources["rollout_batch_size"] == "command line"
    n = recipe["n_samples_per_prompt"]
    assert inv.config.data.n_samples_per_prompt == n and inv.sources["n_samples_per_prompt"] == "recipe"
    assert inv.config.data.num_steps_per_rollout == steps and inv.sources["num_steps_per_rollout"] == "derived"


def test_command_line_beats_miles_script_env():
    normal = TINY.plan(TINY.Options(mode="normal").resolve()).engine["num_rollout"]
    debug = TINY.plan(TINY.Options(mode="debug_minimal").resolve()).engine["num_rollout"]
    assert normal != debug
    r = invoke(["full-train", "--dry-run", "--mode", "normal"], env={"MILES_SCRIPT_MODE": "debug_minimal"})
    assert r.exit_code == 0
    assert f"│ {normal} " in r.output.split("│ --num-rollout ")[1][:40]
    r = invoke(["full-train", "--dry-run"], env={"MILES_SCRIPT_MODE": "debug_minimal"})
    assert f"│ {debug} " in r.output.split("│ --num-rollout ")[1][:40]


def test_recipe_option_reaches_the_engine():
    inv = resolve_invocation("train", TINY, TINY.Options(train_deterministic=False), {}, [])
    assert inv.config.train.deterministic_mode is False
    inv = resolve_invocation("train", TINY, TINY.Options(), {}, [])
    assert inv.config.train.deterministic_mode is True


def test_dry_run_prints_table_and_starts_nothing(tmp_path):
    r = invoke(["full-train", "--dry-run", "--output-dir", str(tmp_path / "o"), "--model-dir", str(tmp_path / "m")])
    assert r.exit_code == 0, r.output
    assert "Prepare steps" in r.output and "sft-warm-start" in r.output
    assert not (tmp_path / "o").exists() and not (tmp_path / "m").exists()


@pytest.mark.parametrize("argv", [["--help"], ["train", "--help"], ["docker-build", "--help"], ["docker-build", "--variant", "cu13", "--image-tag", "latest", "--dry-run"]])
def test_light_commands_import_nothing_heavy(argv):
    code = (
        "import sys\n"
        f"sys.argv = ['miles'] + {argv!r}\n"
        "from miles_cli.main import main\n"
        "try:\n    main()\nexcept SystemExit:\n    pass\n"
        "heavy = [m for m in ('torch', 'ray', 'transformers', 'sglang', 'megatron') if m in sys.modules]\n"
        "print('HEAVY=' + ','.join(heavy))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60).stdout
    assert "HEAVY=\n" in out, out[-500:]
