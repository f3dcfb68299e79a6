"""An SGLang engine spanning two nodes, on Ray's own two-node test cluster (no real SGLang runs).

`--rollout-num-gpus-per-engine 2` with `--actor-num-gpus-per-node 1` makes one engine of two nodes.
The server command is tests/sglang_backend/fake_multinode_sglang.py, which records the argv each node
got and serves the built-in engine on node rank 0 once the other node joined. Through the real
factory, fleet and sglang-router the test checks: each node's argv (same flags, `--node-rank` 0 and
1, one `--dist-init-addr` on node 0), that each node's process runs on the node of its placement
bundle (two different Ray nodes), generation through the router, that killing the process of node 1
restarts *both* nodes (new processes, the old ones gone), that a node exiting at start fails the
engine naming that node, and that shutdown leaves no server process.

What this does not prove: that a real multi-node SGLang engine forms its NCCL group (no such run
here; docs/rollout.md says so).

The two cluster tests are slow (a two-node Ray cluster, two model processes, a restart); the first test
(placement options and GPU ids per node, no Ray) is fast.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from miles.config.resolve import build_config, resolve
from miles.prepare.tiny_model import create_tiny_qwen3
from miles.rollout.engine.base import GenerateRequest, SamplingParams

pytest.importorskip("sglang_router")

FAKE = Path(__file__).with_name("fake_multinode_sglang.py")


@pytest.fixture(scope="module")
def cluster():
    import ray
    from ray.cluster_utils import Cluster

    c = Cluster(initialize_head=True, connect=False, head_node_args={"num_cpus": 2, "resources": {"node_head": 1}, "include_dashboard": False})
    c.add_node(num_cpus=2, resources={"node_worker": 1})
    c.wait_for_nodes(timeout=60)
    ray.init(address=c.address, log_to_driver=False, configure_logging=False)
    yield c
    ray.shutdown()
    c.shutdown()


def _config(model, record: Path, **values):
    base = {
        "rollout_backend": "sglang", "hf_checkpoint": str(model), "prompt_data": "p.jsonl", "rollout_batch_size": 2,
        "global_batch_size": 2, "num_rollout": 1, "device": "cpu", "actor_num_gpus_per_node": 1, "rollout_num_gpus": 2,
        "rollout_num_gpus_per_engine": 2, "sglang_server_command": f"{sys.executable} {FAKE} --record-dir {record}",
        "use_fault_tolerance": True, "rollout_health_check_interval": 1.0, "rollout_health_check_timeout": 10.0,
        "sglang_server_start_timeout": 120.0,
    }  # fmt: skip
    return resolve(build_config({**base, **values}, environ={}))


def _spread_bundles(n: int):
    """A placement group of one CPU bundle per node, and the driver's `bundle_of` over it."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    pg = ray.util.placement_group([{"CPU": 1.0} for _ in range(n)], strategy="STRICT_SPREAD")
    ray.get(pg.ready(), timeout=60)

    def bundle_of(who):
        return {"scheduling_strategy": PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=who[1])}

    return pg, bundle_of


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie is not serving; reap it if it is ours
    try:
        return Path(f"/proc/{pid}/status").read_text().split("State:")[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _wait(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.2)


def test_each_node_of_an_engine_gets_its_bundle_and_its_own_gpus(tmp_path, monkeypatch):
    """GPUs: 2 engines of 16 GPUs on nodes of 8. Node r of engine e runs on bundle e*16 + 8r and sees
    the GPU ids of bundles e*16 + 8r ... + 7 (what Ray reported for them), node 0 likewise."""
    import miles.rollout.engine.fleet as fleet_module
    import miles.ray.sglang_server_actor as server_actor
    from miles.ray.placement import engine_actor_options as _engine_actor_options
    from miles.ray.engine_factory import make_engine

    cfg = _config(
        "/models/m", tmp_path, actor_num_gpus_per_node=8, rollout_num_gpus=32, rollout_num_gpus_per_engine=16, device="cuda",
        rollout_batch_size=8, global_batch_size=8,
    )
    options = _engine_actor_options(cfg, {"num_cpus": 0.5, "num_gpus": 1.0}, lambda who: {"bundle": who[1]}, "cuda")
    assert [o["bundle"] for o in options] == [0, 16]
    assert [[b["bundle"] for b in o["node_bundles"]] for o in options] == [[8], [24]]
    assert [b["bundle"] for b in options[1]["gpu_bundles"]] == list(range(16, 32))
    monkeypatch.setattr(server_actor, "gpu_ids_of_bundles", lambda bundles: [f"g{b['bundle']}" for b in bundles])
    made = {}
    monkeypatch.setattr(fleet_module, "EngineFleet", lambda launcher, **k: made.update(k, launcher=launcher))
    make_engine(cfg, device="cuda", actor_options=options, log_dir=tmp_path)
    cls, _, kwargs = made["launcher"].make_actor(1, 7)
    assert cls is server_actor.SGLangServerActor
    assert kwargs["gpu_ids"] == [f"g{b}" for b in range(16, 24)]
    assert kwargs["nodes"] == [{"actor_options": {"num_cpus": 0.5, "num_gpus": 1.0, "bundle": 24}, "gpu_ids": [f"g{b}" for b in range(24, 32)]}]


@pytest.mark.slow
def test_an_engine_on_two_nodes_starts_serves_restarts_and_stops_as_one(cluster, tmp_path):
    import ray

    from miles.ray.placement import engine_actor_options as _engine_actor_options
    from miles.ray.engine_factory import make_engine

    model = create_tiny_qwen3(tmp_path / "model", seed=0)
    record = tmp_path / "record"
    cfg = _config(model, record)
    pg, bundle_of = _spread_bundles(2)
    options = _engine_actor_options(cfg, {"num_cpus": 1}, bundle_of, "cpu")
    assert len(options) == 1 and len(options[0]["node_bundles"]) == 1  # one engine, one other node
    fleet = make_engine(cfg, device="cpu", actor_options=options, log_dir=tmp_path / "run")
    try:
        info = ray.get(fleet.slots[0].actor.info.remote(), timeout=60)
        (node1,) = info["nodes"]
        argv0, argv1 = info["argv"], node1["argv"]
        addr = argv0[argv0.index("--dist-init-addr") + 1]
        assert argv0[argv0.index("--nnodes") + 1] == "2" and argv0[argv0.index("--node-rank") + 1] == "0"
        assert argv0[argv0.index("--tp-size") + 1] == "2"  # the engine's TP group spans both nodes
        rank = argv1.index("--node-rank") + 1
        assert argv1[rank] == "1" and argv1[:rank] + argv1[rank + 1 :] == argv0[:rank] + argv0[rank + 1 :]  # only the rank differs
        assert addr.split(":")[0] == fleet.slots[0].url.split("//")[1].split(":")[0]  # node 0's address
        # Each process on the node of its own bundle, the two bundles on two different nodes.
        bundle_nodes = ray.util.placement_group_table(pg)["bundles_to_node_id"]
        assert (info["node_id"], node1["node_id"]) == (bundle_nodes[0], bundle_nodes[1]) and bundle_nodes[0] != bundle_nodes[1]
        recorded = {p.name: json.loads(p.read_text()) for p in record.glob("*.json")}
        key = addr.replace(":", "_")
        assert set(recorded) == {f"{key}-node-0.json", f"{key}-node-1.json"}
        assert [recorded[f"{key}-node-{r}.json"]["pid"] for r in (0, 1)] == [info["pid"], node1["pid"]]
        assert recorded[f"{key}-node-1.json"]["cuda_visible_devices"] == ""  # --device cpu

        out = fleet.submit(GenerateRequest([3, 4, 5], SamplingParams(max_new_tokens=3, temperature=0), True)).result(120)
        assert len(out.output_ids) == 3

        # Node 1 dies: the whole engine is restarted (both nodes), and serves after the next weight update.
        os.kill(node1["pid"], signal.SIGKILL)
        _wait(lambda: fleet.restarts == 1 and fleet.slots[0].state == "new", 180, "the fleet to restart the engine")
        assert not _alive(info["pid"]) and not _alive(node1["pid"])  # node 0's server went with it
        again = ray.get(fleet.slots[0].actor.info.remote(), timeout=60)
        assert again["pid"] != info["pid"] and again["nodes"][0]["pid"] != node1["pid"]
        assert again["argv"][again["argv"].index("--dist-init-addr") + 1] != addr  # a fresh rendezvous
        assert _alive(again["pid"]) and _alive(again["nodes"][0]["pid"])
        assert (again["node_id"], again["nodes"][0]["node_id"]) == (bundle_nodes[0], bundle_nodes[1])
        fleet.begin_weight_update()
        fleet.end_weight_update(1)
        out = fleet.submit(GenerateRequest([3, 4, 5], SamplingParams(max_new_tokens=2, temperature=0), True)).result(120)
        assert len(out.output_ids) == 2 and out.weight_version == 1
    finally:
        fleet.shutdown()
    pids = [again["pid"], again["nodes"][0]["pid"]]
    _wait(lambda: not any(_alive(p) for p in pids), 60, "both nodes' servers to stop")
    ray.util.remove_placement_group(pg)


@pytest.mark.slow
def test_a_node_that_exits_at_start_fails_the_engine_naming_that_node(cluster, tmp_path):
    import ray

    from miles.ray.placement import engine_actor_options as _engine_actor_options
    from miles.ray.sglang_server_actor import SGLangServerActor

    model = create_tiny_qwen3(tmp_path / "model", seed=0)
    record = tmp_path / "record"
    cfg = _config(model, record, sglang_server_command=f"{sys.executable} {FAKE} --record-dir {record} --exit-on-node-rank 1")
    pg, bundle_of = _spread_bundles(2)
    (opts,) = _engine_actor_options(cfg, {"num_cpus": 1}, bundle_of, "cpu")
    nodes = [{"actor_options": o} for o in opts.pop("node_bundles")]
    actor = ray.remote(SGLangServerActor).options(**opts, max_restarts=0).remote(cfg, index=0, seed=0, log_dir=str(tmp_path / "run"), nodes=nodes)
    t0 = time.monotonic()
    with pytest.raises(Exception) as e:
        ray.get(actor.url.remote(), timeout=180)
    assert time.monotonic() - t0 < 120  # at once, not after --sglang-server-start-timeout
    assert "node 1 of SGLang engine 0 exited with code 5" in str(e.value)
    assert "[fake sglang] node 1 of 2" in str(e.value)  # that node's own log comes with it
    ray.util.remove_placement_group(pg)
