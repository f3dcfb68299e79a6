"""The thread policy (miles/ray/threads.py): each actor's torch threads are the node's cores divided
among the processes that compute at the same time there, pinned to disjoint cores when the phases
overlap; and a run's training rank really runs with that count. Expected values are hand-computed."""

from __future__ import annotations

import os

import pytest

from miles.config.resolve import build_config, resolve, resolve_device
from miles.ray.threads import Share, ThreadPlan, plan, share_of

BASE = {"prompt_data": "x.jsonl", "rollout_batch_size": 4, "n_samples_per_prompt": 2, "num_rollout": 3, "actor_num_gpus_per_node": 1}
ASYNC = {"train_async": True, "use_rollout_logprobs": True}


def config(device: str = "cpu", **values):
    return resolve_device(resolve(build_config({**BASE, **values}, environ={})), device)


def plan_of(cfg, who, cores):
    return plan(share_of(cfg, who), cores)


def test_default_run_gives_each_phase_every_core():
    cfg = config()  # one rank, the in-process engine, synchronous: train and generate take turns
    assert share_of(cfg, 0) == Share(0, 1, pin=False)
    assert share_of(cfg, "rollout") == Share(0, 1, pin=False)
    assert plan_of(cfg, 0, [0, 1]) == ThreadPlan(2, None)
    assert plan_of(cfg, "rollout", [0, 1]) == ThreadPlan(2, None)


def test_overlap_splits_the_cores_and_pins_them_apart():
    cfg = config(**ASYNC)  # trainer and engine at once on 2 cores: one each, disjoint
    assert plan_of(cfg, 0, [0, 1]) == ThreadPlan(1, (0,))
    assert plan_of(cfg, "rollout", [0, 1]) == ThreadPlan(1, (1,))
    # 16 cores, a taskset limit respected (the ids this process may use, in order)
    cores = list(range(8, 24))
    assert plan_of(cfg, 0, cores) == ThreadPlan(8, tuple(range(8, 16)))
    assert plan_of(cfg, "rollout", cores) == ThreadPlan(8, tuple(range(16, 24)))


def test_fully_async_overlaps_too():
    cfg = config(fully_async=True, use_rollout_logprobs=True)
    assert share_of(cfg, 0) == Share(0, 2, pin=True)


def test_eight_colocated_gpus_on_sixty_four_cores_never_oversubscribe():
    cfg = config("cuda", actor_num_gpus_per_node=8, colocate=True, global_batch_size=8)
    shares = [share_of(cfg, r) for r in range(8)]
    assert shares == [Share(r, 8, pin=False) for r in range(8)]
    assert {plan(s, range(64)).threads for s in shares} == {8}
    assert plan_of(cfg, "rollout", range(64)) == ThreadPlan(64, None)  # one engine, alone in its phase


def test_two_nodes_count_only_their_own_processes():
    # 8 ranks fill node 0 (bundles 0-7), 8 engine servers node 1 (bundles 8-15), overlapped: 8 per node
    cfg = config("cuda", actor_num_gpus_per_node=8, rollout_num_gpus=8, global_batch_size=8, **ASYNC)
    assert share_of(cfg, 3) == Share(3, 8, pin=True)
    assert plan_of(cfg, 3, range(64)) == ThreadPlan(8, tuple(range(24, 32)))
    assert share_of(cfg, ("engine", 2)) == Share(2, 8, pin=True)
    assert plan_of(cfg, ("engine", 2), range(64)) == ThreadPlan(8, tuple(range(16, 24)))
    assert plan_of(cfg, "rollout", range(64)) == ThreadPlan(1, None)  # it only coordinates the servers


def test_engine_servers_on_cpu_share_one_node():
    cfg = config(actor_num_gpus_per_node=2, rollout_num_gpus=2, global_batch_size=4)
    assert [share_of(cfg, w) for w in (0, 1, ("engine", 0), ("engine", 1))] == [
        Share(0, 2, False), Share(1, 2, False), Share(0, 2, False), Share(1, 2, False)]
    assert plan_of(cfg, ("engine", 1), range(6)) == ThreadPlan(3, None)
    overlapped = config(actor_num_gpus_per_node=2, rollout_num_gpus=2, global_batch_size=4, **ASYNC)
    assert plan_of(overlapped, ("engine", 1), range(8)) == ThreadPlan(2, (6, 7))  # after rank 0, rank 1, engine 0


def test_fewer_cores_than_processes_is_one_thread_each_unpinned():
    cfg = config(actor_num_gpus_per_node=4, global_batch_size=4, **ASYNC)  # 4 ranks + the engine on 2 cores
    assert share_of(cfg, 3) == Share(3, 5, pin=True)
    assert plan_of(cfg, 3, [0, 1]) == ThreadPlan(1, None)
    assert plan_of(cfg, "rollout", [0, 1]) == ThreadPlan(1, None)


def test_a_critic_rank_takes_its_ranks_share():
    cfg = config(actor_num_gpus_per_node=2, global_batch_size=4, advantage_estimator="ppo", **ASYNC)
    assert share_of(cfg, ("critic", 1)) == share_of(cfg, 1) == Share(1, 3, pin=True)


def test_no_pinning_without_sched_setaffinity(monkeypatch):
    monkeypatch.delattr(os, "sched_setaffinity")
    assert plan(Share(1, 2, pin=True), [0, 1, 2, 3]) == ThreadPlan(2, None)


@pytest.mark.parametrize("overlapped", [False, True])
def test_a_training_rank_runs_with_the_planned_threads(ray_session, overlapped):
    """Through Ray, as a run starts it: the rank's own torch threads and affinity (red when the actor
    keeps one thread, or is not pinned under --train-async)."""
    import ray

    from miles.ray.actors import TrainWorkerActor
    from miles.ray.hosting import start_actor
    from miles.ray.threads import node_cores

    cores = node_cores()
    if len(cores) < 2:
        pytest.skip("one core: every plan is one thread")
    half = len(cores) // 2
    expected = (half, cores[:half]) if overlapped else (len(cores), cores)
    cfg = config(**(ASYNC if overlapped else {}))
    worker = start_actor(TrainWorkerActor, cfg, rank=0, world_size=1, device="cpu", label="rank 0", actor_options={"num_cpus": 0})
    ray.get(worker.ready_ref, timeout=120)
    assert ray.get(worker.handle.threads.remote(), timeout=60) == expected
    ray.kill(worker.handle)


def test_a_standalone_engine_server_refuses_a_bad_omp_num_threads(tmp_path):
    """`python -m miles.rollout.engine.server` takes its torch threads from OMP_NUM_THREADS (1 when
    unset): a value that is no count is one sentence and exit 2, before the model loads."""
    import subprocess
    import sys

    env = {**os.environ, "OMP_NUM_THREADS": "two"}
    p = subprocess.run([sys.executable, "-m", "miles.rollout.engine.server", "--model-path", str(tmp_path / "none")],
                       env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2, p.stderr
    assert p.stderr.strip().splitlines()[-1] == "OMP_NUM_THREADS='two': the engine server's torch threads must be a positive integer."


# -- the user's OMP_NUM_THREADS caps the policy (the usual knob; two threads collapse on a busy machine) --


def test_the_users_omp_num_threads_caps_every_plan_and_keeps_the_pinned_cores():
    from miles.ray.threads import capped, user_thread_cap

    assert user_thread_cap({}) is None and user_thread_cap({"OMP_NUM_THREADS": ""}) is None
    assert user_thread_cap({"OMP_NUM_THREADS": "1"}) == 1
    assert capped(plan(Share(0, 1, pin=False), [0, 1]), 1) == ThreadPlan(1, None)
    assert capped(plan(Share(1, 2, pin=True), [0, 1, 2, 3]), 1) == ThreadPlan(1, (2, 3))
    assert capped(plan(Share(0, 1, pin=False), [0, 1]), 8) == ThreadPlan(2, None)  # a cap never adds threads
    assert capped(plan(Share(0, 1, pin=False), [0, 1]), None) == ThreadPlan(2, None)


def test_the_cap_reaches_the_actors_through_the_runs_environment(monkeypatch):
    """ray_session gives every actor the user's value (Ray's own OMP_NUM_THREADS in a worker is 1), and
    `apply_share` there takes it (red when either end drops it)."""
    import ray

    from miles.ray import cluster, threads

    seen = {}
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kw: seen.update(kw))
    monkeypatch.setattr(ray, "shutdown", lambda: None)
    monkeypatch.setattr("miles.ray.hosting.end_hosted_actors", lambda: [])
    monkeypatch.setattr(cluster, "_reap", lambda pids: None)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    with cluster.ray_session(config(), {}, 2):
        pass
    env = seen["runtime_env"]["env_vars"]
    assert env[threads.USER_CAP_ENV] == "1" and env["OMP_NUM_THREADS"] == "1"
    applied = []
    monkeypatch.setattr(threads, "apply", lambda p: applied.append(p) or p)
    monkeypatch.setattr(threads, "node_cores", lambda: [0, 1])
    monkeypatch.setenv(threads.USER_CAP_ENV, env[threads.USER_CAP_ENV])
    assert threads.apply_share(Share(0, 1, pin=False)) == ThreadPlan(1, None)
    monkeypatch.delenv(threads.USER_CAP_ENV)
    assert threads.apply_share(Share(0, 1, pin=False)) == ThreadPlan(2, None)


def test_a_busy_machine_gets_one_line_naming_the_setting():
    from miles.ray.threads import busy_node_hint

    assert busy_node_hint(2, 0.8, None) is None  # idle
    assert busy_node_hint(2, 3.0, 1) is None  # the user already capped it
    assert busy_node_hint(1, 9.0, None) is None  # one core: one thread anyway
    line = busy_node_hint(2, 3.04, None)
    assert "load 3.0 on 2 cores" in line and "OMP_NUM_THREADS=1" in line


def test_a_bad_omp_num_threads_stops_a_run_before_anything_starts(tmp_path):
    """`miles full-train` with OMP_NUM_THREADS=two: exit 2, one sentence naming it, nothing written."""
    import subprocess
    import sys

    env = {**os.environ, "OMP_NUM_THREADS": "two", "COLUMNS": "400", "NO_COLOR": "1"}
    p = subprocess.run([sys.executable, "-m", "miles_cli.main", "full-train"], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2, p.stderr[-1500:]
    assert "OMP_NUM_THREADS='two': give a positive integer" in p.stderr and "Traceback" not in p.stderr
    assert list(tmp_path.iterdir()) == []
