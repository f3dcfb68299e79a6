"""Placement and the driver's memory order, without a cluster: bundles sorted by (node, GPU id), the
GPU count refused before Ray waits, the colocated offload order, and the manager actor's methods."""

from __future__ import annotations

import inspect

import pytest

from miles.config.resolve import build_config, resolve, resolve_device
from miles.errors import UserError
from miles.ray.placement import check_gpu_count, sorted_bundles

BASE = {"prompt_data": "x.jsonl", "rollout_batch_size": 4, "n_samples_per_prompt": 2, "num_rollout": 3, "actor_num_gpus_per_node": 1}


def config(**values):
    return resolve(build_config({**BASE, **values}, environ={}))


def test_bundles_sort_by_node_then_gpu_id():
    # What Ray may hand back for 8 bundles on two nodes: interleaved, GPU ids out of order, "10" after "9".
    table = [(0, "10.0.0.2", "1"), (1, "10.0.0.1", "3"), (2, "10.0.0.2", "0"), (3, "10.0.0.1", "10"),
             (4, "10.0.0.1", "9"), (5, "10.0.0.2", "2"), (6, "10.0.0.1", "0"), (7, "10.0.0.2", "3")]
    assert sorted_bundles(table) == [6, 1, 4, 3, 2, 0, 5, 7]


def test_cpu_bundles_keep_rays_order():
    assert sorted_bundles([(i, "127.0.0.1", None) for i in range(4)]) == [0, 1, 2, 3]


def test_more_gpus_than_there_are_is_one_sentence():
    cfg = config(actor_num_gpus_per_node=4, rollout_num_gpus=4, global_batch_size=8)  # 4 ranks + 4 engine GPUs apart
    check_gpu_count(cfg, 8)
    with pytest.raises(UserError) as e:
        check_gpu_count(cfg, 4)
    message = str(e.value)
    assert message.startswith("this run needs 8 GPUs (4 training workers and 4 rollout engine device(s), each on its own GPU) but 4 are available")
    assert message.count(".") == 1 and "--colocate" in message
    check_gpu_count(config(actor_num_gpus_per_node=4, rollout_num_gpus=4, global_batch_size=8, colocate=True), 4)


def test_a_gpu_layout_that_cannot_fit_exits_2_before_ray_starts(tmp_path, monkeypatch):
    """Through the driver: the check runs before the placement group is asked for."""
    from miles.ray import cluster

    cfg = config(actor_num_gpus_per_node=2, rollout_num_gpus=2, global_batch_size=8)
    monkeypatch.setattr("miles.ray.device.pick_device", lambda device: "cuda")
    monkeypatch.setattr(cluster, "torch_device_count", lambda: 3)
    monkeypatch.setattr(cluster, "ray_session", _no_ray)
    with pytest.raises(UserError, match=r"^this run needs 4 GPUs .* but 3 are available"):
        with cluster.start_cluster(cfg, run_dir=tmp_path, env={}):
            pass


class _no_ray:
    def __init__(self, *a):
        pass

    def __enter__(self):
        return None

    def __exit__(self, *a):
        return False


class _Recorder:
    """A fake cluster: the trainer and the manager record the calls the driver makes, in order."""

    def __init__(self, with_critic: bool = False):
        self.calls: list[str] = []
        rec = self

        class Method:
            def __init__(self, name):
                self.name = name

            def remote(self, *args, **kwargs):
                rec.calls.append(self.name + (f"({','.join(kwargs['tags'])})" if kwargs.get("tags") else ""))
                return None

        class Manager:
            def __getattr__(self, name):
                return Method(name)

        class Trainer:
            handles: list = []

            def offload(self):
                rec.calls.append("trainer.offload")

            def onload(self):
                rec.calls.append("trainer.onload")

            def train(self, data_ref, rollout_id, critic_refs=None, push=None):
                rec.calls.append("trainer.train" + ("(values)" if critic_refs else ""))
                return {"train/loss": 0.0}

        class Critic:
            def offload(self):
                rec.calls.append("critic.offload")

            def onload(self):
                rec.calls.append("critic.onload")

            def train_critic(self, data_ref, rollout_id):
                rec.calls.append("critic.train")
                return {"critic/value_loss": 0.0}, ["values-ref"]

        self.manager = type("Hosted", (), {"handle": Manager()})()
        self.trainer = Trainer()
        self.critic = Critic() if with_critic else None


def test_colocated_memory_order(monkeypatch):
    """Before training: engine memory released, trainer back. After: trainer out, engine weights in,
    weights updated, then the KV cache (upstream's order: the two are never both at full size)."""
    import miles.ray.driver as driver

    cfg = resolve_device(config(colocate=True, offload_train=True, offload_rollout=True), "cuda")
    fake = _Recorder()
    monkeypatch.setattr(driver, "wait", lambda refs, what, timeout=None: refs)
    monkeypatch.setattr(driver, "_update_weights", lambda cfg, cluster, version, pushed=False: (fake.calls.append("update_weights"), (0.0, {}))[1])
    driver._train(cfg, fake, None, 0)
    driver._sync_after_train(cfg, fake, version=1)
    assert fake.calls == ["offload", "trainer.onload", "trainer.train",
                          "trainer.offload", "onload(weights)", "update_weights", "onload(kv_cache,cuda_graph)"]


def test_colocated_memory_order_with_the_ppo_critic(monkeypatch):
    """PPO: the critic comes to the device, trains and leaves before the actor comes; the actor trains
    on the critic's values; both are off the device before the engine resumes; --num-critic-only-steps
    skips the actor."""
    import miles.ray.driver as driver

    cfg = resolve_device(config(colocate=True, offload_train=True, offload_rollout=True, advantage_estimator="ppo",
                                num_critic_only_steps=1), "cuda")
    fake = _Recorder(with_critic=True)
    monkeypatch.setattr(driver, "wait", lambda refs, what, timeout=None: refs)
    monkeypatch.setattr(driver, "_update_weights", lambda cfg, cluster, version, pushed=False: (fake.calls.append("update_weights"), (0.0, {}))[1])
    assert driver._train(cfg, fake, None, 0)["critic/value_loss"] == 0.0
    assert fake.calls == ["offload", "critic.onload", "critic.train", "critic.offload"]  # rollout 0: critic only
    fake.calls.clear()
    driver._train(cfg, fake, None, 1)
    driver._sync_after_train(cfg, fake, version=2)
    assert fake.calls == ["offload", "critic.onload", "critic.train", "critic.offload", "trainer.onload", "trainer.train(values)",
                          "trainer.offload", "critic.offload", "onload(weights)", "update_weights", "onload(kv_cache,cuda_graph)"]


def test_on_cpu_the_driver_makes_no_memory_calls(monkeypatch):
    import miles.ray.driver as driver

    cfg = resolve_device(config(colocate=True, offload_train=True, offload_rollout=True), "cpu")
    fake = _Recorder()
    monkeypatch.setattr(driver, "wait", lambda refs, what, timeout=None: refs)
    monkeypatch.setattr(driver, "_update_weights", lambda cfg, cluster, version, pushed=False: (fake.calls.append("update_weights"), (0.0, {}))[1])
    driver._train(cfg, fake, None, 0)
    driver._sync_after_train(cfg, fake, version=1)
    assert fake.calls == ["trainer.train", "update_weights"]


def test_the_manager_actor_has_every_method_of_the_manager():
    """RolloutManagerActor forwards by hand (it holds the manager): a method added to RolloutManager
    and not to the actor would be an AttributeError in the middle of a run."""
    from miles.ray.actors import RolloutManagerActor
    from miles.ray.rollout_manager import RolloutManager

    public = {n for n, f in inspect.getmembers(RolloutManager, inspect.isfunction) if not n.startswith("_")}
    actor = RolloutManagerActor.__ray_metadata__.modified_class
    missing = sorted(n for n in public if not callable(getattr(actor, n, None)))
    assert not missing, f"RolloutManagerActor lacks {missing}"
    assert not any(inspect.iscoroutinefunction(f) for _, f in inspect.getmembers(actor, inspect.isfunction))  # a threaded actor
