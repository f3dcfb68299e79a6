"""`--loss-type sft_loss`'s bad inputs through the `miles` program: options that shape generation, which
the SFT rollout never does, exit 2 with one sentence naming the option, no traceback."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

CASES = [
    (["--dynamic-sampling-filter-path", "miles.rollout.filters.check_reward_nonzero_std"],
     "--dynamic-sampling-filter-path filters generated groups, and --loss-type sft_loss trains on the data's conversations"),
    (["--over-sampling-batch-size", "64"], "--over-sampling-batch-size is not used with --loss-type sft_loss"),
]


def miles(args: list[str], cwd) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": "400", "NO_COLOR": "1"}
    return subprocess.run([sys.executable, "-m", "miles_cli.main", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("args, sentence", CASES, ids=lambda x: x[0] if isinstance(x, list) else None)
def test_generation_options_with_sft_loss_exit_2(tmp_path, args, sentence):
    r = miles(["train", "--loss-type", "sft_loss", *args], tmp_path)
    assert r.returncode == 2, r.stdout[-800:] + r.stderr[-800:]
    assert sentence in r.stderr.replace("\n", " "), r.stderr[-1500:]
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize("args", [c[0] for c in CASES], ids=lambda x: x[0])
def test_the_same_options_pass_the_check_without_sft_loss(tmp_path, args):
    """Without sft_loss the options are valid: the run gets past them (and stops at the missing model)."""
    r = miles(["train", *args, "--dry-run"], tmp_path)
    assert "sft_loss" not in r.stderr, r.stderr[-1500:]
