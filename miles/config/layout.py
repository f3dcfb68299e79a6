"""Where a run's processes go, derived once from the options: training ranks, engines, placement bundles.

`resolve()` (miles/config/resolve.py) stores a `RunLayout` on the configuration (`cfg.layout`); the
driver, the placement group, the rollout manager and `--dry-run` read it instead of recomputing it:

    cfg.layout.train_ranks        # --actor-num-nodes × --actor-num-gpus-per-node
    cfg.layout.engines            # EngineLayout: engines, GPUs each, nodes each spans
    cfg.layout.engine_bundles     # devices the engines take (1 for the in-process engine)
    cfg.layout.bundles            # placement bundles: colocated max(ranks, engine devices), else their sum
    cfg.layout.offload_train      # --offload-train as it takes effect (never on CPU); None until the device is known

Pure data and arithmetic: nothing here imports torch, Ray or a rollout backend.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from miles.errors import UserError


@dataclasses.dataclass(frozen=True)
class EngineLayout:
    """How the rollout GPUs are cut into engines."""

    num_engines: int
    gpus_per_engine: int
    nodes_per_engine: int  # > 1 when an engine's tensor-parallel group spans nodes
    gpus_per_node: int


def engine_layout(cfg: Any) -> EngineLayout:
    """SGLang engines = rollout GPUs / GPUs per engine. Colocated runs use the training GPUs for rollouts."""
    c = cfg.cluster
    per_node = c.actor_num_gpus_per_node
    per_engine = c.rollout_num_gpus_per_engine
    total = c.rollout_num_gpus
    if total is None:
        total = c.actor_num_nodes * per_node if c.colocate else per_engine
    if per_engine < 1 or total < per_engine or total % per_engine:
        raise UserError(
            f"--rollout-num-gpus ({total}) must be a positive multiple of --rollout-num-gpus-per-engine ({per_engine}).",
            option="--rollout-num-gpus",
        )
    if per_engine > per_node and per_engine % per_node:
        raise UserError(
            f"--rollout-num-gpus-per-engine ({per_engine}) spans nodes, so it must be a multiple of the GPUs per node ({per_node}).",
            option="--rollout-num-gpus-per-engine",
        )
    nodes = max(1, per_engine // per_node) if per_engine > per_node else 1
    return EngineLayout(total // per_engine, per_engine, nodes, per_node)


@dataclasses.dataclass(frozen=True)
class RunLayout:
    """The derived shape of one run (see the module docstring)."""

    train_ranks: int
    colocate: bool
    engine_servers: bool  # engines run as servers (--rollout-num-gpus, or SGLang); else one engine inside the manager
    engines: EngineLayout
    num_rollout: int | None  # None until the dataset is read when --num-epoch sets the length
    device: str  # "cpu", "cuda", or "auto" until the run picks one
    offload_train: bool | None  # as it takes effect on `device`; None while the device is "auto"
    offload_rollout: bool | None
    wants_offload: tuple[bool, bool] = (False, False)  # (--offload-train, --offload-rollout) as given

    @property
    def engine_bundles(self) -> int:
        """Devices (placement bundles) the rollout engines take."""
        return self.engines.num_engines * self.engines.gpus_per_engine

    @property
    def bundles(self) -> int:
        """Placement bundles: colocated, rank i and engine device i share bundle i (two engine devices
        must not share one rank's bundle: the trainer taking that device's other half would never be
        placed); otherwise a bundle per rank, then one per engine device."""
        if self.colocate:
            return max(self.train_ranks, self.engine_bundles)
        return self.train_ranks + self.engine_bundles

    def describe(self) -> str:
        """One line for --dry-run."""
        e = self.engines
        where = "colocated with the trainer" if self.colocate else "beside the trainer"
        if not self.engine_servers:
            engines = f"1 in-process engine ({where})"
        else:
            engines = f"{e.num_engines} engine server(s) × {e.gpus_per_engine} device(s)" + (
                f" over {e.nodes_per_engine} nodes" if e.nodes_per_engine > 1 else "") + f" ({where})"
        steps = "from --num-epoch once the dataset is read" if self.num_rollout is None else str(self.num_rollout)
        if self.offload_train is None:
            offload = (f"offload train {'on' if self.wants_offload[0] else 'off'}, rollout {'on' if self.wants_offload[1] else 'off'} "
                       "on a GPU, off on CPU (--device auto picks at start)")
        else:
            offload = f"offload train {'on' if self.offload_train else 'off'}, rollout {'on' if self.offload_rollout else 'off'} on {self.device}"
        return (f"{self.train_ranks} training rank(s); {engines}; {self.bundles} placement bundle(s); "
                f"num_rollout {steps}; {offload}")


def run_layout(cfg: Any, *, device: str | None = None) -> RunLayout:
    """The layout of `cfg` on `device` (default: --device as given; "auto" leaves offload undecided).

    On CPU the weights already live in host memory: offload/onload would be Ray round trips that do
    nothing, so they take effect only on a GPU (the options say "no effect on CPU")."""
    c = cfg.cluster
    device = device or c.device
    sglang = cfg.rollout.rollout_backend == "sglang"
    engines = engine_layout(cfg) if sglang else EngineLayout(c.rollout_num_gpus or 1, 1, 1, c.actor_num_gpus_per_node)
    decided = device in ("cpu", "cuda")
    return RunLayout(
        train_ranks=c.actor_num_nodes * c.actor_num_gpus_per_node,
        colocate=c.colocate,
        engine_servers=sglang or c.rollout_num_gpus is not None,
        engines=engines,
        num_rollout=cfg.data.num_rollout,
        device=device,
        offload_train=(c.offload_train and device != "cpu") if decided else None,
        offload_rollout=(c.offload_rollout and device != "cpu") if decided else None,
        wants_offload=(bool(c.offload_train), bool(c.offload_rollout)),
    )
