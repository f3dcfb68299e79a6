"""Shared test setup: one torch thread (2-core machines, several test processes), no GPU, quiet Ray,
and `warm_start`: the embedded recipe's SFT warm start, built once and cached across test runs."""

import os
from dataclasses import dataclass
from pathlib import Path

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")


@dataclass(frozen=True)
class WarmStart:
    """The default recipe's prepared inputs: `model_dir`/`data_dir` to pass as --model-dir/--data-dir
    (full-train then skips every prepare step), the SFT model and the task's train/eval files."""

    model_dir: Path
    data_dir: Path
    sft_model: Path
    train: Path
    eval: Path


@pytest.fixture(scope="session")
def warm_start(request) -> WarmStart:
    """The tiny-qwen3 recipe's prepare steps (model, two-digit addition task, 375-step SFT warm start at
    about 0.2 held-out accuracy, where sampled groups mix right and wrong answers), run with the recipe's
    own plan into pytest's cache directory (.pytest_cache/d/miles-warm-start). The first run of the
    suite builds it (about 30 s on an idle 2-core machine); later runs find the sentinels and skip.
    Tests that need gradients to be non-zero (rewards that vary) start from here."""
    from miles.prepare.runner import run_prepare_steps
    from recipes.tiny_qwen3 import Options, plan

    root = Path(request.config.cache.mkdir("miles-warm-start"))
    options = Options(model_dir=str(root / "models"), data_dir=str(root / "data"), output_dir=str(root / "runs"), run_id="unused")
    recipe = plan(options)
    run_prepare_steps(recipe.prepare)
    task = Path(recipe.engine["prompt_data"]).parent
    return WarmStart(root / "models", root / "data", Path(recipe.engine["hf_checkpoint"]), task / "train.jsonl", task / "eval.jsonl")
