"""The weight sync that rides on the train call (miles.ray.weight_sync.order_with_train): in the
synchronous loop with the in-process engine, from the second sync on the trainer ranks send the new
weights at the end of their train call instead of in a driver call of its own.

The loop test starts from the recipe's SFT warm start so gradients are non-zero and the weights move
every step: with `--check-weight-update-equal` a sync that did not reach the engine (or reached it
with the previous step's weights) stops the run. It also watches the run's processes: the sync's
shared memory (a memfd) must not start torch's `torch_shm_manager` daemon (~110 MB of RSS)."""

from __future__ import annotations

import json
import threading
import types

import pytest

import miles.ray.driver as driver
import miles.ray.weight_sync as ws
from miles.config.resolve import build_config, resolve
from miles.ray.driver import run_training


def warm_config(warm_start, run_dir, **values):
    """Three rollouts of 8 prompts x 4 samples at T = 0.8 from the warm start (rewards vary)."""
    base = {
        "hf_checkpoint": str(warm_start.sft_model), "prompt_data": str(warm_start.train), "label_key": "label",
        "rm_type": "exact_match", "rollout_batch_size": 8, "n_samples_per_prompt": 4, "num_rollout": 3,
        "actor_num_gpus_per_node": 1, "rollout_max_response_len": 4, "rollout_skip_special_tokens": True,
        "rollout_temperature": 0.8, "device": "cpu", "lr": 3e-4, "micro_batch_size": 8, "deterministic_mode": True,
        "check_weight_update_equal": True,
    }
    return resolve(build_config({**base, **values}, environ={}))


def _watch_process_names(stop: threading.Event, seen: set[str]) -> None:
    """Every 0.1 s, the names of this process's descendants (Ray's node and its workers among them)."""
    import psutil

    while not stop.wait(0.1):
        for p in psutil.Process().children(recursive=True):
            try:
                seen.add(p.name())
            except psutil.Error:
                continue


def test_the_loop_sends_each_steps_weights_inside_the_train_call_and_the_engine_has_them(warm_start, tmp_path, ray_session):
    run_dir = tmp_path / "run"
    stop, seen = threading.Event(), set()
    watcher = threading.Thread(target=_watch_process_names, args=(stop, seen), daemon=True)
    watcher.start()
    try:
        result = run_training(warm_config(warm_start, run_dir), run_dir=run_dir, run_id="sync-with-train")
    finally:
        stop.set()
        watcher.join(timeout=5)
    assert any(name.startswith("raylet") for name in seen), f"the watcher saw none of the run's processes: {sorted(seen)}"
    assert not any(name.startswith("torch_shm") for name in seen), "the weight sync started torch_shm_manager"
    assert result.final_step == 3  # --check-weight-update-equal passed after every step's sync
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if "train/grad_norm" in r]
    assert len(train_rows) == 3 and all(r["train/grad_norm"] > 0 for r in train_rows), "the weights did not move: nothing was checked"
    # The step's train row carries the sync (sent in the train call); no later row of the step has one.
    assert all(r["perf/weight_sync_bytes"] > 0 and r["perf/weight_sync_time"] > 0 for r in train_rows)
    assert sum("perf/weight_sync_time" in r for r in rows) == 3


def _cluster(critic=None):
    manager = types.SimpleNamespace(_actor_id=bytes.fromhex("ab12"))
    return types.SimpleNamespace(critic=critic, manager=types.SimpleNamespace(handle=manager))


@pytest.fixture
def known_in_process(monkeypatch):
    targets = ws.InProcessTargets(manager=object(), node_id="n", session=True)
    monkeypatch.setattr(ws, "_IN_PROCESS", {"ab12": targets})
    return targets


def _cfg(**values):
    paths = types.SimpleNamespace(sft_model="model", train="train.jsonl")  # never opened: only the flags matter
    return warm_config(paths, None, **values)


def test_only_the_synchronous_loop_with_a_known_in_process_engine_sends_with_train(known_in_process, monkeypatch):
    order = driver._push_with_train(_cfg(), _cluster(), version=4)
    assert order.targets is known_in_process and order.version == 4
    assert driver._push_with_train(_cfg(train_async=True, use_tis=True), _cluster(), version=4) is None  # a rollout runs meanwhile
    assert driver._push_with_train(_cfg(), _cluster(critic=object()), version=4) is None  # ppo: the critic trains first
    monkeypatch.setattr(ws, "_IN_PROCESS", {})  # the first sync has not shown the engine is in-process
    assert driver._push_with_train(_cfg(), _cluster(), version=4) is None
