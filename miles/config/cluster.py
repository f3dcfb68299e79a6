"""Cluster options: where the training actors and the rollout engines run.

On a CPU machine a "GPU" of these options is one worker process (a Ray actor with one CPU); the
names stay those upstream users know, so the same flags describe a laptop run and a GPU cluster.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from miles.config.fields import Derived, option


@dataclass
class ClusterConfig:
    actor_num_nodes: int = option(1, help="Number of nodes for the training actors.")
    actor_num_gpus_per_node: int = option(
        8, help="Devices per node for the training actors (on CPU: data-parallel worker processes)."
    )
    rollout_num_gpus: int | None = option(
        None,
        help=(
            "Total devices for the rollout engines; unset = the training devices under --colocate, else one engine's "
            "worth (--rollout-num-gpus-per-engine)."
        ),
    )
    rollout_num_gpus_per_engine: int = option(
        1, help="Devices per rollout engine (the engine's tensor-parallel size)."
    )
    colocate: bool = option(
        False,
        help=(
            "On GPU, the training actors and the rollout engine share devices and take turns; without it each "
            "gets its own device. On CPU both are processes on the same cores either way."
        ),
    )
    offload_train: bool | None = option(
        help=(
            "Move the training actors' weights and optimizer state to host memory while the rollout engine "
            "generates (no effect on CPU, where they already live in host memory)."
        ),
        derived=Derived(
            "true under --colocate, else false; an explicit --no-offload-train is respected",
            lambda c: c.cluster.colocate,
        ),
    )
    offload_rollout: bool | None = option(
        help=(
            "Move the rollout engine's weights to host memory while the actors train (no effect on CPU)."
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
        "auto", help="Device for training and the built-in rollout engine; auto picks cuda when available.",
        in_eval=True,
    )
