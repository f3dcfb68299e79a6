"""`miles` on an existing Ray cluster: a local two-node cluster, the tiny recipe, trainer and engine apart.

The test starts Ray's own multi-node test cluster in this process (`ray.cluster_utils.Cluster`: a head
and a worker node, one CPU each, bound to this machine), runs `miles full-train --mode debug_minimal
--no-colocate` against it through `RAY_ADDRESS` (the training worker and the rollout engine each need
a whole CPU, so one node cannot hold both), checks the run finished and that its two actors ran on
the two different nodes, and stops the cluster. A second check gives the same address with
`--ray-address` and only resolves the plan.

Run: `pytest -m slow tests/e2e/test_ray_cluster.py` (about 2-3 minutes on 2 cores).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cli.helpers import dry_run_ok

MILES = [sys.executable, "-m", "miles_cli.main"]


@pytest.fixture(scope="module")
def cluster():
    import ray
    from ray.cluster_utils import Cluster

    c = Cluster(initialize_head=True, connect=False, head_node_args={"num_cpus": 1, "resources": {"node_head": 1}, "include_dashboard": False})
    c.add_node(num_cpus=1, resources={"node_worker": 1})
    c.wait_for_nodes(timeout=60)
    yield c
    if ray.is_initialized():
        ray.shutdown()
    c.shutdown()


@pytest.mark.slow
def test_tiny_recipe_runs_with_trainer_and_engine_on_different_nodes(cluster, tmp_path):
    import ray

    env = {**os.environ, "RAY_ADDRESS": cluster.address, "OMP_NUM_THREADS": "1", "COLUMNS": "200"}
    args = [
        "full-train", "--mode", "debug_minimal", "--no-colocate", "--num-gpus-per-node", "1",
        "--model-dir", str(tmp_path / "models"), "--data-dir", str(tmp_path / "data"), "--output-dir", str(tmp_path / "runs"),
        "--run-id", "two-nodes",
    ]  # fmt: skip
    r = subprocess.run(MILES + args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "│ --ray-address" in r.stdout and cluster.address in r.stdout  # the resolved table shows the cluster
    rows = [json.loads(line) for line in (tmp_path / "runs/two-nodes/metrics.jsonl").read_text().splitlines()]
    assert {row["step"] for row in rows} >= {1, 2, 3}

    ray.init(address=cluster.address, log_to_driver=False, configure_logging=False)
    # The run's actors, by class (miles/ray/actors.py): exactly the training worker and the rollout
    # manager, which owns the engine. Two actors on two nodes = trainer and engine apart.
    actors = [a for a in ray._private.state.actors().values() if a.get("ActorClassName") in ("TrainWorkerActor", "RolloutManagerActor")]
    assert len(actors) == 2, actors
    nodes = [a["Address"]["NodeID"] for a in actors]
    assert nodes[0] != nodes[1]
    assert set(nodes) == {n["NodeID"] for n in ray.nodes()}
    ray.shutdown()


def test_ray_address_option_and_env_var_resolve_to_the_cluster(tmp_path):
    for extra, env in ((["--ray-address", "10.0.0.1:6379"], {}), ([], {"RAY_ADDRESS": "10.0.0.1:6379"})):
        r = subprocess.run(
            MILES + ["train", "--dry-run", *extra], cwd=tmp_path, env={**os.environ, **env, "COLUMNS": "200"},
            capture_output=True, text=True, timeout=120,
        )
        assert dry_run_ok(r), r.stderr  # the table is printed even where the recipe's inputs are unprepared
        (row,) = [line for line in r.stdout.splitlines() if "--ray-address" in line]
        assert "10.0.0.1:6379" in row and ("command line" in row if extra else "env RAY_ADDRESS" in row), row
