"""Where each actor of a run goes: one PACK placement group, bundles in (node, GPU id) order.

Upstream's layout, from `cfg.layout` (miles/config/layout.py): colocated, `max(ranks, engine devices)`
bundles with rank i and engine device i sharing bundle i (each takes half); otherwise a bundle per
rank, then one per engine device. Ray numbers a group's bundles in the order it was asked for them,
not by where they landed, so the logical slots are mapped onto the bundles sorted by (node address,
GPU id): the ranks of one engine's TP group, and a trainer and the engine sharing its GPU, sit on one
node, on neighbouring GPUs. A layout that needs more GPUs than the cluster has exits 2 before Ray waits.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

from miles.config.engine import EngineConfig
from miles.errors import UserError
from miles.ray.waiting import ACTOR_START_TIMEOUT_S, wait

BUNDLE_PROBE_TIMEOUT_S = 120.0


def sorted_bundles(table: list[tuple[int, str, str | None]]) -> list[int]:
    """Bundle indices in (node address, GPU id) order, from (index, node address, GPU id or None) rows.
    GPU ids sort as numbers ("10" after "9"); the sort is stable, so on one CPU node the order is Ray's."""

    def key(row: tuple[int, str, str | None]):
        _, node, gpu = row
        return (node, -1 if gpu is None else int(gpu) if gpu.isdigit() else 0, gpu or "")

    return [index for index, _, _ in sorted(table, key=key)]


def check_gpu_count(cfg: EngineConfig, available: float) -> None:
    """Exit 2, before Ray waits for a placement group that can never be placed, when the layout needs
    more GPUs than there are."""
    layout = cfg.layout
    needed = layout.bundles
    if available >= needed:
        return
    engines = f"{layout.engine_bundles} rollout engine device(s)" if layout.engine_servers else "the rollout engine"
    how = "sharing the training GPUs (--colocate)" if layout.colocate else "each on its own GPU"
    raise UserError(
        f"this run needs {needed} GPUs ({layout.train_ranks} training workers and {engines}, {how}) but "
        f"{available:g} are available; add --colocate, lower --actor-num-gpus-per-node or --rollout-num-gpus.",
        option="--colocate" if not layout.colocate else "--rollout-num-gpus",
    )


def _bundle_table(group, n: int, device: str) -> list[tuple[int, str, str | None]]:
    """(index, node address, GPU id) of every bundle: the node from Ray's placement-group table, the GPU
    id (GPU runs only) from one tiny task in each bundle."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    node_of = ray.util.placement_group_table(group)["bundles_to_node_id"]
    addresses = {node["NodeID"]: node["NodeManagerAddress"] for node in ray.nodes()}
    gpus: list[str | None] = [None] * n
    if device == "cuda":

        @ray.remote(num_cpus=0, num_gpus=0.01)
        def gpu_id() -> str:
            return str(ray.get_gpu_ids()[0])

        strategy = lambda i: PlacementGroupSchedulingStrategy(placement_group=group, placement_group_bundle_index=i)  # noqa: E731
        gpus = wait([gpu_id.options(scheduling_strategy=strategy(i)).remote() for i in range(n)],
                    f"the GPU ids of {n} placement bundles", BUNDLE_PROBE_TIMEOUT_S)
    return [(i, addresses.get(node_of[i], str(node_of[i])), gpus[i]) for i in range(n)]


@contextlib.contextmanager
def placement(cfg: EngineConfig, device: str):
    """Yields `bundle_of(rank | "rollout" | ("engine", i)) -> actor options`; removes the group
    afterwards (a shared Ray cluster gets its resources back)."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    layout = cfg.layout
    unit = {"CPU": 1.0, **({"GPU": 1.0} if device == "cuda" else {})}
    n = layout.bundles
    group = ray.util.placement_group([dict(unit) for _ in range(n)], strategy="PACK")
    wait(group.ready(), f"a placement group of {n} bundles of {unit}", ACTOR_START_TIMEOUT_S)
    order = sorted_bundles(_bundle_table(group, n, device))

    def bundle_of(who) -> dict[str, Any]:
        if who == "rollout" or isinstance(who, tuple):  # the in-process engine, or ("engine", i) = device i of the engines
            slot = who[1] if isinstance(who, tuple) else 0
            index = slot if layout.colocate else layout.train_ranks + slot
        else:
            index = who
        return {"scheduling_strategy": PlacementGroupSchedulingStrategy(placement_group=group, placement_group_bundle_index=order[index])}

    try:
        yield bundle_of
    finally:
        ray.util.remove_placement_group(group)


def engine_actor_options(cfg: EngineConfig, options: dict[str, Any], bundle_of: Callable, device: str) -> list[dict[str, Any]]:
    """Ray options of each engine server's actor: the bundle of its first device. An SGLang engine of
    N GPUs also gets "gpu_bundles" (its N bundles), whose GPU ids become its CUDA_VISIBLE_DEVICES.

    Colocated, engine device i shares bundle i with training rank i (see `placement`); on GPUs more
    engine devices than training GPUs is a user error (they would not be colocated)."""
    layout = cfg.layout
    g, n = layout.engines.gpus_per_engine, layout.engines.num_engines
    world = layout.train_ranks
    if layout.colocate and n * g > world and device == "cuda":
        raise UserError(
            f"--colocate shares the {world} training GPUs with the rollout engines, and --rollout-num-gpus asks for "
            f"{n * g}; lower --rollout-num-gpus to at most {world} or drop --colocate.",
            option="--rollout-num-gpus",
        )
    if cfg.rollout.rollout_backend != "sglang":
        return [{**options, **bundle_of(("engine", i))} for i in range(n)]
    out = []
    for e in range(n):
        opts = {**options, **bundle_of(("engine", e * g))}
        if device == "cuda":
            opts["gpu_bundles"] = [bundle_of(("engine", e * g + k)) for k in range(g)]
        if layout.engines.nodes_per_engine > 1:  # the first bundle of each other node of the engine
            per_node = layout.engines.gpus_per_node
            opts["node_bundles"] = [{**options, **bundle_of(("engine", e * g + r * per_node))} for r in range(1, layout.engines.nodes_per_engine)]
        out.append(opts)
    return out
