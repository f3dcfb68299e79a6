"""Cluster options: where the training actors and the rollout engines run.

On a CPU machine a "GPU" of these options is one worker process (a Ray actor with one CPU); the
names stay those upstream users know, so the same flags describe a laptop run and a GPU cluster.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from miles.config.fields import Derived, option


def _actor_devices(c) -> int:
    return c.cluster.actor_num_nodes * c.cluster.actor_num_gpus_per_node


@dataclass
class ClusterConfig:
    actor_num_nodes: int = option(1, help="Number of nodes for the training actors.")
    actor_num_gpus_per_node: int = option(
        8, help="Devices per node for the training actors (on CPU: data-parallel worker processes)."
    )
    rollout_num_gpus: int | None = option(
        help="Total devices for the rollout engines.",
        derived=Derived(
            "--actor-num-nodes × --actor-num-gpus-per-node under --colocate, else --rollout-num-gpus-per-engine",
            lambda c: _actor_devices(c) if c.cluster.colocate else c.cluster.rollout_num_gpus_per_engine,
        ),
    )
    rollout_num_gpus_per_engine: int = option(1, help="Devices per rollout engine (the engine's tensor-parallel size).")
    num_gpus_per_node: int = option(8, help="Devices per node, used to lay out engines that span nodes.")
    colocate: bool = option(
        False, help="Put the training actors and the rollout engines on the same devices, taking turns."
    )
    offload_train: bool | None = option(
        help=(
            "Move the training actors' weights and optimizer state out of device memory while the rollout "
            "engines generate (no effect on CPU, where they already live in host memory)."
        ),
        derived=Derived(
            "true under --colocate, else false; an explicit --no-offload-train is respected",
            lambda c: c.cluster.colocate,
        ),
    )
    offload_rollout: bool | None = option(
        help=(
            "Release the rollout engines' weights and KV cache from device memory while the actors train "
            "(no effect on CPU)."
        ),
        derived=Derived(
            "true under --colocate, else false; an explicit --no-offload-rollout is respected",
            lambda c: c.cluster.colocate,
        ),
    )
    ray_address: str | None = option(
        None,
        help="Address of an existing Ray cluster; unset starts a private Ray node inside the driver process.",
        env="RAY_ADDRESS",
    )
    device: Literal["auto", "cpu", "cuda"] = option(
        "auto", help="Device for training and the built-in rollout engine; auto picks cuda when available."
    )
