"""Engine servers behind the real sglang-router in the driver loop: weights never pass through the
driver, a dead engine stops a run without fault tolerance, dynamic sampling aborts and re-queues.

The loop runs in-process on the session's Ray (tests/ray/conftest.py), on the tiny model.
"""

from __future__ import annotations

import json
import os
import pickle
import signal
import threading
import time

import pytest

from miles.config.resolve import build_config, resolve
from miles.prepare.tiny_model import create_tiny_qwen3
from miles.ray.driver import run_training

pytest.importorskip("sglang_router")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("fleet")
    model = create_tiny_qwen3(root / "model", seed=0)
    rows = [{"input": f"{a}+{b}=", "label": str(a + b)} for a in range(5) for b in range(5)]
    (root / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root, model


def config(files, **values):
    root, model = files
    base = {
        "hf_checkpoint": str(model), "prompt_data": str(root / "train.jsonl"), "label_key": "label", "rm_type": "exact_match",
        "rollout_batch_size": 4, "n_samples_per_prompt": 2, "num_rollout": 2, "actor_num_gpus_per_node": 1,
        "rollout_max_response_len": 2, "rollout_skip_special_tokens": True, "device": "cpu", "lr": 1e-3,
        "micro_batch_size": 4, "check_weight_update_equal": True,
    }
    return resolve(build_config({**base, **values}, environ={}))


def rows(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


class DriverTraffic:
    """Counts the pickled bytes the driver sends to actors and gets back from them during weight syncs."""

    def __init__(self, monkeypatch):
        import ray.actor

        import miles.ray.driver as driver

        self.bytes = 0
        self.syncs = 0
        self._on = False
        remote, wait, update = ray.actor.ActorMethod.remote, driver.wait, driver._update_weights

        def counted_remote(method, *args, **kwargs):
            if self._on:
                self.bytes += len(pickle.dumps((args, kwargs)))
            return remote(method, *args, **kwargs)

        def counted_wait(refs, what, *a, **k):
            out = wait(refs, what, *a, **k)
            if self._on:
                self.bytes += len(pickle.dumps(out))
            return out

        def counted_update(*a, **k):
            self._on, self.syncs = True, self.syncs + 1
            try:
                return update(*a, **k)
            finally:
                self._on = False

        monkeypatch.setattr(ray.actor.ActorMethod, "remote", counted_remote)
        monkeypatch.setattr(driver, "wait", counted_wait)
        monkeypatch.setattr(driver, "_update_weights", counted_update)


@pytest.mark.parametrize("engines, mode", [(None, "broadcast"), (2, "broadcast"), (2, "tensor")])
def test_weight_bytes_never_pass_through_the_driver(files, tmp_path, ray_session, monkeypatch, engines, mode):
    """In-process engine (Ray objects), 2 servers behind the router by broadcast over gloo, and by
    handles to shared memory (--update-weight-transfer-mode tensor): every sync is checked bit-exact on
    the engines (--check-weight-update-equal), yet the driver moves only a few KB."""
    from miles.rollout.engine.base import tensor_nbytes

    from transformers import AutoModelForCausalLM

    model_bytes = sum(tensor_nbytes(p) for p in AutoModelForCausalLM.from_pretrained(files[1]).parameters())
    traffic = DriverTraffic(monkeypatch)
    run_dir = tmp_path / "run"
    extra = {} if engines is None else {"rollout_num_gpus": engines, "update_weight_transfer_mode": mode}
    result = run_training(config(files, **extra), run_dir=run_dir, run_id="w")
    assert result.final_step == 2 and traffic.syncs == 3  # the first sync, then one per rollout
    assert model_bytes > 400_000
    assert traffic.bytes < 0.02 * model_bytes, f"the driver carried {traffic.bytes} bytes over 3 syncs of {model_bytes}"
    logged = rows(run_dir)
    if engines:
        state = json.loads((run_dir / "engines.json").read_text())
        assert [e["state"] for e in state["engines"]] == ["serving", "serving"]
        assert all(e["url"].startswith("http://127.0.0.1:") for e in state["engines"]) and state["router"].startswith("http://127.0.0.1:")
        assert [r["rollout/engine_restarts"] for r in logged if "rollout/engine_restarts" in r] == [0.0, 0.0]


def _kill_an_engine_after_step(run_dir, step: int, killed: list[int]) -> threading.Thread:
    """SIGKILL engine 0's process once `step` is in the metrics (reads <run dir>/engines.json)."""

    def watch() -> None:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            try:
                if any(r.get("step") == step for r in rows(run_dir)):
                    pid = json.loads((run_dir / "engines.json").read_text())["engines"][0]["pid"]
                    os.kill(pid, signal.SIGKILL)
                    killed.append(pid)
                    return
            except (FileNotFoundError, json.JSONDecodeError):
                pass
            time.sleep(0.05)

    t = threading.Thread(target=watch, daemon=True)
    t.start()
    return t


def test_a_dead_engine_without_fault_tolerance_stops_the_run_with_one_sentence(files, tmp_path, ray_session):
    from miles.errors import RunStopped

    run_dir = tmp_path / "dies"
    killed: list[int] = []
    watcher = _kill_an_engine_after_step(run_dir, 1, killed)
    cfg = config(files, rollout_num_gpus=2, num_rollout=30, rollout_health_check_interval=0.5, rollout_health_check_timeout=5)
    t0 = time.monotonic()
    with pytest.raises(RunStopped) as err:
        run_training(cfg, run_dir=run_dir, run_id="dies")
    watcher.join(1)
    message = str(err.value)
    assert killed and f"pid {killed[0]}" in message and message.startswith("rollout engine 0 (http://127.0.0.1:")
    assert "--use-fault-tolerance" in message and "\n" not in message
    assert err.value.exit_code == 1
    assert time.monotonic() - t0 < 300  # stopped, not hung
    assert max(r["step"] for r in rows(run_dir)) < 30


def test_a_killed_engine_with_fault_tolerance_is_restarted_with_current_weights(files, tmp_path, ray_session):
    """Colocated like the tiny recipe (one training rank, two engines: upstream's layout gives each engine
    its own bundle; two in rank 0's bundle left no room for the trainer, a hang)."""
    run_dir = tmp_path / "ft"
    killed: list[int] = []
    watcher = _kill_an_engine_after_step(run_dir, 1, killed)
    cfg = config(
        files, rollout_num_gpus=2, num_rollout=5, use_fault_tolerance=True, colocate=True,
        rollout_health_check_interval=0.5, rollout_health_check_timeout=5,
        save_debug_rollout_data=str(tmp_path / "samples" / "{rollout_id}.jsonl"),
    )
    result = run_training(cfg, run_dir=run_dir, run_id="ft")  # --check-weight-update-equal is on: every
    watcher.join(1)  # sync after the restart is verified on both engines, the new one included
    assert killed and result.final_step == 5
    restarts = [r["rollout/engine_restarts"] for r in rows(run_dir) if "rollout/engine_restarts" in r]
    assert restarts[0] == 0.0 and restarts[-1] == 1.0
    state = json.loads((run_dir / "engines.json").read_text())
    assert [e["state"] for e in state["engines"]] == ["serving", "serving"] and state["restarts"] == 1
    assert state["engines"][0]["pid"] != killed[0]
    # Rollout r is generated with weight version r (the first sync is 0, the one after rollout r is
    # r + 1): no sample came from the restarted engine before it had the current weights.
    for r in range(5):
        lines = (tmp_path / "samples" / f"{r}.jsonl").read_text().splitlines()
        assert {json.loads(line)["weight_version"] for line in lines} == {r}


def _served(fleet, index: int) -> dict:
    """Engine `index`'s own counters (requests it answered, and what it has running and waiting)."""
    return fleet.slots[index].client.call("/server_info", method="GET", timeout=30)["internal_states"][0]


def test_requests_of_a_killed_engine_are_sent_again_exactly_once(files, tmp_path, ray_session):
    """16 seeded requests over 2 servers (one request at a time each, so engine 0 has a queue), then
    SIGKILL engine 0: every request still returns, complete and with the tokens it would have had
    (same seed, any engine), and the survivor answered its own 8 plus exactly the re-queued ones: no
    re-queued request went to the dead engine again (that would count twice) or got lost (hang)."""
    from miles.config.fault_tolerance import FaultToleranceConfig
    from miles.rollout.engine.base import GenerateRequest, SamplingParams
    from miles.rollout.engine.builtin import BuiltinEngine
    from miles.ray.engine_factory import builtin_fleet

    _, model = files
    # The health monitor stays out of it (its first check is an hour away): the failed requests
    # themselves must find the dead engine.
    ft = FaultToleranceConfig(use_fault_tolerance=True, rollout_health_check_first_wait=3600)
    reqs = [GenerateRequest([5, 6, 7], SamplingParams(temperature=1.0, max_new_tokens=24, seed=i), True, f"r{i:02d}") for i in range(16)]
    fleet = builtin_fleet(str(model), num_engines=2, policy="round_robin", ft=ft, max_batch_size=1, log_dir=tmp_path)
    try:
        futures = [fleet.submit(r) for r in reqs]
        deadline = time.monotonic() + 120
        while True:  # all 16 arrived (8 per engine, round robin) before the kill
            states = [_served(fleet, i) for i in (0, 1)]
            if all(s["requests"] + s["running"] + s["waiting"] >= 8 for s in states):
                break
            assert time.monotonic() < deadline, f"the requests never all reached the engines: {states}"
            time.sleep(0.01)
        os.kill(fleet.slots[0].pid, signal.SIGKILL)
        results = [f.result(timeout=300) for f in futures]
        survivor = _served(fleet, 1)["requests"]
    finally:
        fleet.shutdown()
    reference = BuiltinEngine(str(model), max_batch_size=16).generate(reqs)
    assert [r.output_ids for r in results] == [r.output_ids for r in reference]
    assert all(r.finish_reason["type"] != "abort" for r in results)
    assert fleet.restarts == 1 and 1 <= fleet.requeued <= 8
    assert survivor == 8 + fleet.requeued, (survivor, fleet.requeued)
