"""The in-process weight sync's sender against a real rollout manager (tiny model, no Ray actors), and
the start-up objects every actor freezes out of the garbage collector.

The sender's calls go straight to `RolloutManager.load_weight_bucket` (a stand-in for the actor
handle's `.remote`, with `ray.get` the identity), so what is checked is what the manager receives and
does with it: handles to the sender's shared-memory buffer on the same node, tensors on another; with
a session, the engine paused and opened by the first bucket's call and closed at the new version by
the last one's, its weights then bit for bit the sent ones.
"""

from __future__ import annotations

import json

import pytest
import torch

import miles.ray.weight_sync as ws
from miles.config.resolve import build_config, resolve
from miles.prepare.tiny_model import create_tiny_qwen3
from miles.ray.rollout_manager import RolloutManager
from miles.rollout.engine.tensor_ipc import SharedBucket


@pytest.fixture(scope="module")
def manager(tmp_path_factory):
    root = tmp_path_factory.mktemp("ws")
    model = create_tiny_qwen3(root / "model", seed=0)
    (root / "train.jsonl").write_text("".join(json.dumps({"input": f"{a}+1=", "label": str(a + 1)}) + "\n" for a in range(4)))
    cfg = {"hf_checkpoint": str(model), "prompt_data": str(root / "train.jsonl"), "label_key": "label", "rm_type": "exact_match",
           "rollout_batch_size": 2, "n_samples_per_prompt": 2, "num_rollout": 1, "actor_num_gpus_per_node": 1,
           "rollout_max_response_len": 2, "device": "cpu"}
    return RolloutManager(resolve(build_config(cfg, environ={})))


def kind(bucket) -> str:
    return "shared" if isinstance(bucket, SharedBucket) else "handles" if isinstance(bucket, str) else "tensors"


class Recorder:
    """Stands in for the manager's actor handle: `load_weight_bucket.remote(...)` runs the real method."""

    def __init__(self, manager):
        self.calls: list[tuple[str, bool, int | None]] = []
        recorder = self

        class Method:
            @staticmethod
            def remote(bucket, opens=False, closes_at=None):
                recorder.calls.append((kind(bucket), opens, closes_at))
                recorder.states.append(manager.engine._updating if not opens else None)
                return manager.load_weight_bucket(bucket, opens=opens, closes_at=closes_at)

        self.load_weight_bucket = Method
        self.states: list = []


@pytest.fixture
def no_ray(monkeypatch):
    import ray

    monkeypatch.setattr(ray, "get", lambda ref, timeout=None: ref)
    monkeypatch.setattr(ws, "current_node_id", lambda: "node-a")


def new_weights(manager, seed: int) -> list[list[tuple[str, torch.Tensor]]]:
    g = torch.Generator().manual_seed(seed)
    named = [(n, torch.randn(p.shape, generator=g)) for n, p in manager.engine.named_parameters()]
    return [named[:3], named[3:7], named[7:]]


def engine_weights(manager) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in manager.engine.named_parameters()}


def push(sender, buckets, version: int) -> None:
    sender.begin(version)
    for b in buckets:
        sender.send_bucket(b, version)
    sender.finish(version)


def test_a_session_opens_with_the_first_bucket_closes_with_the_last_and_loads_every_weight(manager, no_ray):
    rec = Recorder(manager)
    sender = ws.InProcessTargets(manager=rec, node_id="node-a", session=True).open_sender()
    buckets = new_weights(manager, 1)
    push(sender, buckets, version=7)
    assert rec.calls == [("shared", True, None), ("shared", False, None), ("shared", False, 7)]
    assert rec.states[1:] == [True, True]  # the middle and last buckets arrive inside the open session
    assert manager.engine.weight_version == 7 and not manager.engine._updating and not manager.engine._paused
    got = engine_weights(manager)
    for n, t in (x for b in buckets for x in b):
        assert torch.equal(got[n], t), n

    # The next sync reuses the same shared-memory segment (kept by the sender, grown to the largest bucket).
    segment = sender._segment
    push(sender, new_weights(manager, 2), version=8)
    assert sender._segment is segment
    # One bucket: one call that opens and closes.
    one = [[x for b in new_weights(manager, 5) for x in b]]
    push(sender, one, version=8)
    assert rec.calls[6:] == [("shared", True, 8)]
    got = engine_weights(manager)
    assert all(torch.equal(got[n], t) for n, t in one[0]) and manager.engine.weight_version == 8


def test_sync_after_sync_the_manager_reads_the_new_weights_through_the_segment_it_mapped_once(manager, no_ray):
    rec = Recorder(manager)
    sender = ws.InProcessTargets(manager=rec, node_id="node-a", session=True).open_sender()
    mapped = None
    for version, seed in enumerate((11, 12, 13), start=20):
        bucket = [x for b in new_weights(manager, seed) for x in b]
        push(sender, [bucket], version)
        reader = manager._shared_weights
        mapped = mapped if mapped is not None else reader._flat
        assert reader._flat is mapped  # the sender's buffer, mapped by the first sync and kept
        got = engine_weights(manager)
        assert all(torch.equal(got[n], t) for n, t in bucket), f"version {version}: the engine kept older weights"
        assert manager.engine.weight_version == version and not manager.engine._updating
    assert rec.calls == [("shared", True, v) for v in (20, 21, 22)]


def test_over_the_managers_channel_buckets_skip_ray_and_every_sync_lands_at_its_version(manager, no_ray, monkeypatch):
    import miles.ray.rollout_manager as rm

    monkeypatch.setattr(rm, "current_node_id", lambda: "node-a")  # as in a Ray actor
    targets = manager.begin_weight_update()  # the first sync: the manager names its channel
    manager.end_weight_update(manager.engine.weight_version)
    assert targets.address.startswith("\0miles-weights-")
    rec = Recorder(manager)
    sender = ws.InProcessTargets(manager=rec, node_id="node-a", session=True, address=targets.address).open_sender()
    for version, seed in enumerate((31, 32), start=40):
        buckets = new_weights(manager, seed)
        push(sender, buckets, version)
        got = engine_weights(manager)
        assert all(torch.equal(got[n], t) for b in buckets for n, t in b), f"version {version}: older weights"
        assert manager.engine.weight_version == version and not manager.engine._updating and not manager.engine._paused
    assert rec.calls == []  # no Ray call: every bucket went over the socket
    # An error in the manager comes back to the sender, naming it.
    sender.begin(42)
    sender.send_bucket([("model.not_a_weight", torch.zeros(2))], 42)
    with pytest.raises(RuntimeError, match="not_a_weight"):
        sender.finish(42)
    manager.end_weight_update(41)  # the failed session, ended as the driver's recovery would
    sender.close()


def test_without_a_session_each_bucket_is_sent_at_once_and_the_driver_opens_and_closes(manager, no_ray):
    rec = Recorder(manager)
    sender = ws.InProcessTargets(manager=rec, node_id="node-a").open_sender()
    manager.begin_weight_update()
    push(sender, new_weights(manager, 3), version=9)
    assert rec.calls == [("shared", False, None)] * 3
    manager.end_weight_update(9)
    assert manager.engine.weight_version == 9


def test_a_manager_on_another_node_gets_tensors(manager, no_ray):
    rec = Recorder(manager)
    sender = ws.InProcessTargets(manager=rec, node_id="node-b", session=True).open_sender()
    buckets = new_weights(manager, 4)
    push(sender, buckets, version=10)
    assert rec.calls == [("tensors", True, None), ("tensors", False, None), ("tensors", False, 10)]
    got = engine_weights(manager)
    assert all(torch.equal(got[n], t) for b in buckets for n, t in b)


def test_start_up_objects_are_frozen_and_later_garbage_is_still_collected():
    """`freeze_startup_objects` (called by every actor once set up, and by the driver) leaves what
    exists out of later collections; cycles made afterwards are still collected."""
    import subprocess
    import sys

    code = """
import gc, weakref
from miles.ray.hosting import freeze_startup_objects
class Node: pass
freeze_startup_objects()
assert gc.get_freeze_count() > 1000, gc.get_freeze_count()
a = Node(); a.self = a; probe = weakref.ref(a); del a
gc.collect()
assert probe() is None
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
