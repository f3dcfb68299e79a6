"""The driver loop in-process on the session's Ray: data parallel over gloo, separate placement, resume.

The data-parallel test starts from the recipe's SFT warm start (tests/conftest.py `warm_start`), where
sampled answers are sometimes right: rewards vary, gradients are non-zero and the weights move, so
"DP=2 equals DP=1" compares two trainings, not two copies of the initial weights.
"""

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


def warm_config(warm_start, run_dir, **values):
    """Two rollouts of 8 prompts x 4 samples at T = 0.8 from the warm start (held-out accuracy ~0.2)."""
    base = {
        "hf_checkpoint": str(warm_start.sft_model), "prompt_data": str(warm_start.train), "label_key": "label",
        "rm_type": "exact_match", "rollout_batch_size": 8, "n_samples_per_prompt": 4, "num_rollout": 2,
        "actor_num_gpus_per_node": 1, "rollout_max_response_len": 4, "rollout_skip_special_tokens": True,
        "rollout_temperature": 0.8, "device": "cpu", "lr": 3e-4, "micro_batch_size": 8, "deterministic_mode": True,
        "check_weight_update_equal": True, "save": str(run_dir / "ckpt"), "load": str(run_dir / "ckpt"),
    }
    return resolve(build_config({**base, **values}, environ={}))


def metric_rows(run_dir) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def warm_dp1(warm_start, tmp_path_factory, ray_session):
    """One training worker on the warm start: the reference the data-parallel runs must equal."""
    one = tmp_path_factory.mktemp("dp1")
    run_training(warm_config(warm_start, one), run_dir=one, run_id="dp1")
    return one


@pytest.mark.parametrize("backend", ["torch", "fsdp"])
def test_two_data_parallel_workers_match_one(backend, warm_dp1, warm_start, tmp_path, ray_session):
    """DP=2 over gloo in the real loop, with DDP (torch) or FSDP2 (fsdp), ends with the weights of
    DP=1 and logs its per-step losses (same global batch, same samples)."""
    from safetensors.torch import load_file

    one, two = warm_dp1, tmp_path / "dp2"
    run_training(warm_config(warm_start, two, actor_num_gpus_per_node=2, train_backend=backend), run_dir=two, run_id="dp2")
    for run_dir in (one, two):
        rows = [r for r in metric_rows(run_dir) if "train/grad_norm" in r]
        assert len(rows) == 2 and all(r["train/grad_norm"] > 0 for r in rows), "no gradient: nothing was compared"
        assert all(0 < r["rollout/raw_reward"] < 1 for r in rows), "rewards did not vary"
    losses = [[r["train/loss"] for r in metric_rows(d) if "train/loss" in r] for d in (one, two)]
    assert losses[1] == pytest.approx(losses[0], abs=1e-5, rel=0), losses
    a, b = final_weights(one), final_weights(two)
    initial = load_file(str(warm_start.sft_model / "model.safetensors"))
    moved = max((a[k] - initial[k]).abs().max().item() for k in initial)
    assert moved > 1e-5, "the weights did not move from the warm start"
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


def test_a_killed_worker_ends_the_run_naming_it_and_releases_the_placement_group(files, tmp_path, ray_session):
    """On a shared Ray (the session's, as with --ray-address) a dead actor ends the run at once, with
    one sentence naming it, and the run's placement group is removed (the cluster gets its CPUs back)."""
    import threading
    import time

    import ray

    from miles.ray.actor_death import ActorDied
    from miles.ray.hosting import hosted_actors

    run_dir = tmp_path / "killed"
    hosted_before = len(hosted_actors())

    def kill_the_worker_after_a_step():
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            path = run_dir / "metrics.jsonl"
            if path.exists() and any(json.loads(x)["step"] >= 1 for x in path.read_text().splitlines() if x.strip()):
                break
            time.sleep(0.1)
        # Ray shows the run's actors by their role's class (what `ray list actors` lists with a dashboard).
        alive.update(a["ActorClassName"] for a in ray._private.state.actors().values() if a["State"] == "ALIVE")
        worker = next(a for a in hosted_actors()[hosted_before:] if a.label == "the TrainWorker of rank 0")
        ray.kill(worker.handle, no_restart=True)

    alive: set[str] = set()
    killer = threading.Thread(target=kill_the_worker_after_a_step, daemon=True)
    killer.start()
    with pytest.raises(ActorDied, match=r"^the TrainWorker of rank 0 \(pid \d+\) died while the driver waited for "):
        run_training(config(files, run_dir, num_rollout=200), run_dir=run_dir, run_id="killed")
    killer.join(timeout=60)
    assert {"TrainWorkerActor", "RolloutManagerActor"} <= alive, alive
    assert all(pg["state"] == "REMOVED" for pg in ray.util.placement_group_table().values())


def test_num_epoch_counts_steps_of_rollout_batch_size(files, tmp_path, ray_session):
    """25 prompts, --rollout-batch-size 4, --over-sampling-batch-size 8, one epoch: 25 // 4 = 6 steps
    (sizing by the over-sampling batch would give 25 // 8 = 3)."""
    run_dir = tmp_path / "epoch"
    cfg = config(files, run_dir, num_rollout=None, num_epoch=1, over_sampling_batch_size=8, check_weight_update_equal=False)
    result = run_training(cfg, run_dir=run_dir, run_id="epoch")
    assert result.final_step == 6
