"""Key and param transforms: exact mappings, and MLflow's own validator accepts every mapped key."""

from __future__ import annotations

import dataclasses

import pytest

from miles.config.fields import option
from miles.tracking.keys import (
    MLFLOW_MAX_KEY_LENGTH,
    MLFLOW_MAX_PARAM_VALUE_LENGTH,
    flatten_params,
    mlflow_key,
    prometheus_name,
    wandb_run_id,
)

MLFLOW_CASES = [
    ("rollout/raw_reward", "rollout/raw_reward"),
    ("eval/gsm8k-test/accuracy", "eval/gsm8k-test/accuracy"),
    ("eval/my set:v2/accuracy", "eval/my set:v2/accuracy"),  # space and colon are allowed
    ("eval/a@b/pass@k", "eval/a_b/pass_k"),
    ("perf/tok/s%", "perf/tok/s_"),
    ("a//b", "a/b"),
    ("/lead/trail/", "lead/trail"),
    ("eval/./x", "eval/_/x"),
    ("eval/../x", "eval/__/x"),
    ("train/é", "train/_"),  # MLflow's \w is ASCII-only on the server side; be safe
    ("///", "_"),
]


@pytest.mark.parametrize("key,expected", MLFLOW_CASES)
def test_mlflow_key_mapping(key: str, expected: str) -> None:
    assert mlflow_key(key) == expected


@pytest.mark.parametrize("key", [k for k, _ in MLFLOW_CASES] + ["x" * 400, "a/" * 200, "a" * 248 + "/.b"])
def test_mlflow_accepts_every_mapped_key(key: str) -> None:
    from mlflow.utils.validation import _validate_metric_name, _validate_param_name

    name = mlflow_key(key)
    assert len(name) <= MLFLOW_MAX_KEY_LENGTH
    _validate_metric_name(name)  # raises MlflowException on a bad name
    _validate_param_name(name)


@pytest.mark.parametrize(
    "key,expected",
    [
        ("rollout/raw_reward", "miles_metric_rollout_raw_reward"),
        ("eval/gsm8k-test/accuracy", "miles_metric_eval_gsm8k_test_accuracy"),
        ("eval/ds/pass@4", "miles_metric_eval_ds_pass_at_4"),
        ("perf/tok s.%", "miles_metric_perf_tok_s__"),
    ],
)
def test_prometheus_name(key: str, expected: str) -> None:
    assert prometheus_name(key) == expected


def test_wandb_run_id() -> None:
    assert wandb_run_id("2026-11-30_12:00:01/qwen") == "2026-11-30_12-00-01-qwen"
    assert len(wandb_run_id("r" * 100)) == 64


@dataclasses.dataclass
class _Inner:
    lr: float = 1e-6
    key: str | None = option(None, help="a key", secret=True)


@dataclasses.dataclass
class _Outer:
    inner: _Inner = dataclasses.field(default_factory=_Inner)
    paths: list = dataclasses.field(default_factory=lambda: ["a", "b"])
    name: str | None = None


def test_flatten_params_nested_dicts_and_dataclasses() -> None:
    params = {"cfg": _Outer(inner=_Inner(key="sk-123")), "seed": 1, "d": {"x": {"y": True}}}
    assert flatten_params(params) == {
        "cfg.inner.lr": "1e-06",
        "cfg.inner.key": "***",  # declared secret=True: never reaches a tracking server
        "cfg.paths": '["a", "b"]',
        "cfg.name": "None",
        "seed": "1",
        "d.x.y": "True",
    }
    assert flatten_params(_Outer())["inner.key"] == "None"  # an unset secret is not hidden


def test_flatten_params_cuts_long_values_to_mlflow_limit() -> None:
    flat = flatten_params({"prompt": "x" * 10_000, "short": "y" * MLFLOW_MAX_PARAM_VALUE_LENGTH})
    assert len(flat["prompt"]) == MLFLOW_MAX_PARAM_VALUE_LENGTH
    assert flat["prompt"].endswith("...[cut, 10000 chars]")
    assert flat["short"] == "y" * MLFLOW_MAX_PARAM_VALUE_LENGTH


def test_engine_config_flattens_to_group_dot_option_valid_mlflow_names() -> None:
    from miles.config.engine import EngineConfig

    cfg = EngineConfig()
    flat = flatten_params(cfg)
    assert flat["data.rollout_batch_size"] == str(cfg.data.rollout_batch_size)
    assert flat["tracking.mlflow_experiment_name"] == "miles"
    assert {k.split(".", 1)[1] for k in flat if not k.startswith("run.")} == set(cfg.flat())  # every option, once
    assert {k for k in flat if k.startswith("run.")} == {"run.run_id", "run.run_dir"}  # and which run it is
    assert all(mlflow_key(k) == k for k in flat)  # no renaming needed for real option names
