"""Console helpers: the exact summary line, and the progress bar's columns."""

from __future__ import annotations

import io

from rich.console import Console
from rich.progress import BarColumn, SpinnerColumn, TimeElapsedColumn, TimeRemainingColumn

from miles.tracking.console import format_step_summary, print_step_summary, progress


def test_full_summary_line() -> None:
    metrics = {
        "rollout/raw_reward": 0.4125,
        "rollout/reward_std": 0.12,
        "eval/math/accuracy": 0.25,
        "eval/arith/accuracy": 0.55,
        "eval/arith/reward": 0.9,  # not an accuracy: not shown
        "rollout/response_len_mean": 12.34,
        "perf/rollout_tokens_per_s": 1234.0,
        "perf/train_tokens_per_s": 2_500_000.0,
        "perf/step_time": 3.414,
        "train/loss": 1.0,
    }
    assert format_step_summary(3, metrics, num_steps=10) == (
        "step 3/10 · reward 0.412 ± 0.120 · eval arith 0.550 · eval math 0.250 · len 12.3"
        " · gen 1.2k tok/s · train 2.5M tok/s · 3.41 s"
    )


def test_eval_without_accuracy_shows_its_mean_reward() -> None:
    # f1 (fractional) reports no accuracy: the line shows the mean reward, labelled as such.
    metrics = {"eval/squad/reward": 0.4321, "eval/arith/accuracy": 0.5, "eval/arith/reward": 0.5}
    assert format_step_summary(1, metrics) == "step 1 · eval arith 0.500 · eval squad reward 0.432"


def test_absent_metrics_are_left_out() -> None:
    assert format_step_summary(0, {"eval/arith/accuracy": 1.0}) == "step 0 · eval arith 1.000"
    assert format_step_summary(5, {"perf/rollout_tokens_per_s": 999.0}) == "step 5 · gen 999 tok/s"


def test_print_goes_to_the_given_console_verbatim() -> None:
    out = io.StringIO()
    print_step_summary(1, {"rollout/raw_reward": 0.5}, console=Console(file=out, width=200, color_system=None))
    assert out.getvalue() == "step 1 · reward 0.500\n"


def test_progress_columns() -> None:
    kinds = [type(c) for c in progress(console=Console(file=io.StringIO())).columns]
    for column in (SpinnerColumn, BarColumn, TimeElapsedColumn, TimeRemainingColumn):
        assert column in kinds


def test_a_step_line_fits_an_80_column_console() -> None:
    metrics = {
        "rollout/raw_reward": 0.4125, "rollout/reward_std": 0.12, "eval/math/accuracy": 0.25, "eval/arith/accuracy": 0.55,
        "rollout/response_len_mean": 12.34, "perf/rollout_tokens_per_s": 1234.0, "perf/train_tokens_per_s": 2.5e6,
        "perf/step_time": 3.414,
    }
    assert len(format_step_summary(300, metrics, num_steps=500)) > 80  # too wide without a width
    line = format_step_summary(300, metrics, num_steps=500, width=80)
    assert line == "step 300/500 · reward 0.412 ± 0.120 · eval arith 0.550 · 3.41 s"
    assert format_step_summary(300, metrics, num_steps=500, width=100).endswith("eval math 0.250 · len 12.3 · 3.41 s")
    out = io.StringIO()
    print_step_summary(300, metrics, num_steps=500, console=Console(file=out, width=80, color_system=None))
    assert out.getvalue().count("\n") == 1 and len(out.getvalue()) <= 81


def test_a_step_without_a_reward_shows_its_loss():
    """--loss-type sft_loss steps generate nothing and log no reward: the line shows the loss instead."""
    line = format_step_summary(2, {"train/loss": 1.23456, "perf/step_time": 0.5}, num_steps=5)
    assert line == "step 2/5 · loss 1.235 · 0.50 s"
    rl = format_step_summary(2, {"rollout/raw_reward": 0.5, "train/loss": 1.2}, num_steps=5)
    assert "loss" not in rl and "reward 0.500" in rl
