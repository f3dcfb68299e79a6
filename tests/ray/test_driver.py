"""The driver loop in-process on the session's Ray: data parallel over gloo, separate placement, resume."""

from __future__ import annotations

import json

import pytest
import torch

from miles.config.resolve import build_config, resolve
from miles.prepare.tiny_model import create_tiny_qwen3
from miles.ray.driver import run_training


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("driver")
    model = create_tiny_qwen3(root / "model", seed=0)
    rows = [{"input": f"{a}+{b}=", "label": str(a + b)} for a in range(5) for b in range(5)]
    (root / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root, model


def config(files, run_dir, **values):
    root, model = files
    base = {
        "hf_checkpoint": str(model), "prompt_data": str(root / "train.jsonl"), "label_key": "label", "rm_type": "exact_match",
        "rollout_batch_size": 4, "n_samples_per_prompt": 2, "num_rollout": 2, "actor_num_gpus_per_node": 1,
        "rollout_max_response_len": 2, "rollout_skip_special_tokens": True, "device": "cpu", "lr": 1e-3,
        "micro_batch_size": 4, "deterministic_mode": True, "check_weight_update_equal": True,
        "save": str(run_dir / "ckpt"), "load": str(run_dir / "ckpt"),
    }
    return resolve(build_config({**base, **values}, environ={}))


def final_weights(run_dir):
    from miles.backends.torch.checkpoint import read_model_weights
    from miles.ckpt.trainer_checkpoint import find_latest_checkpoint

    return read_model_weights(str(find_latest_checkpoint(run_dir / "ckpt")[1]))


def test_two_data_parallel_workers_match_one(files, tmp_path, ray_session):
    """DP=2 over gloo in the real loop ends with the weights of DP=1 (same global batch, same samples)."""
    one = tmp_path / "dp1"
    run_training(config(files, one), run_dir=one, run_id="dp1")
    two = tmp_path / "dp2"
    run_training(config(files, two, actor_num_gpus_per_node=2), run_dir=two, run_id="dp2")
    a, b = final_weights(one), final_weights(two)
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-6)


def test_separate_placement_runs_and_resume_continues(files, tmp_path, ray_session):
    run_dir = tmp_path / "sep"
    result = run_training(config(files, run_dir, colocate=False), run_dir=run_dir, run_id="sep")
    assert result.resumed_from is None and result.final_step == 2
    result = run_training(config(files, run_dir, colocate=False, num_rollout=3), run_dir=run_dir, run_id="sep")
    assert result.resumed_from == 1
    steps = sorted({json.loads(x)["step"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()})
    assert steps == [1, 2, 3]
