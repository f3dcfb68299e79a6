"""Torch threads (and CPU cores) per actor: a node's cores divided among the processes that compute at
the same time on that node.

Each computing actor (a training rank, the rollout manager hosting the in-process engine, a built-in
engine server) calls `apply(plan(share_of(cfg, who), node_cores()))` at start. What computes at once:

- The synchronous loop alternates phases (generate, then train, then weight sync), so during training
  only the training ranks compute and during rollout only the engines do: each phase's processes
  share all of the node's cores. Splitting the cores between phases would leave half of them idle in
  each phase (on the 2-core development machine a train step is 0.054 s on one thread, 0.032 s on two;
  docs/benchmarks.md, "Threads per phase").
- Under --train-async / --fully-async the trainer and the engines run at once: every computing process
  on the node gets an equal share, and (Linux, a core or more each) its own disjoint cores through
  `os.sched_setaffinity`, so two processes never migrate onto one core while another idles and one's
  threads never preempt the other's (each phase's time stays what it is alone).
- PPO's critic rank trains before its actor rank (the driver waits for it), on the same bundle: it
  takes its rank's share.

Which node an actor lands on follows the placement group (miles/ray/placement.py): bundles in
(node, GPU id) order, so on GPUs bundle b is on node b // GPUs per node; on CPU every bundle is
counted on one node (a multi-node CPU cluster then under-uses its cores, never oversubscribes them).
With fewer cores than processes, each gets one thread and no pinning. A node's cores are those this
process may run on (`os.sched_getaffinity`: a container's or `taskset`'s limit is respected).

The user's `OMP_NUM_THREADS` (in the environment `miles` runs in) caps every actor's threads, the
usual knob of any torch program: two threads per phase are 1.4-1.7x faster on cores nothing else
uses, but when another process wants a core, libgomp's spinning barriers make them 3-50x slower
(docs/benchmarks.md, "Threads per phase"), so on a shared machine `OMP_NUM_THREADS=1` is the
safer setting. Ray sets every worker's own OMP_NUM_THREADS (miles makes it 1, for the libraries it
does not size), so the driver carries the user's value to the actors as `MILES_USER_OMP_NUM_THREADS`.

`share_of` and `plan` are pure; only `node_cores` and `apply` touch the process.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Mapping, Sequence

USER_CAP_ENV = "MILES_USER_OMP_NUM_THREADS"  # the user's OMP_NUM_THREADS, carried to the actors


@dataclasses.dataclass(frozen=True)
class Share:
    """One process's place among those that compute at the same time on its node."""

    index: int  # this process's position among them (which block of cores it takes when pinned)
    count: int  # how many processes compute at once on the node, this one included; 0: it only coordinates
    pin: bool  # overlapped phases: take disjoint cores


@dataclasses.dataclass(frozen=True)
class ThreadPlan:
    threads: int  # torch intra-op threads
    cores: tuple[int, ...] | None  # CPU ids to pin the process to, or None (the OS schedules it)


def _node(bundle: int, *, device: str, gpus_per_node: int) -> int:
    return bundle // max(1, gpus_per_node) if device == "cuda" else 0


def share_of(cfg: Any, who: Any) -> Share:
    """`who`: a training rank (int), ("critic", rank) (PPO's critic rank), "rollout" (the rollout manager:
    the in-process engine, or only the coordinator of engine servers) or ("engine", i) (built-in engine
    server i). Bundles as `miles.ray.placement.placement` maps them."""
    layout = cfg.layout
    device, per_node = layout.device, cfg.cluster.actor_num_gpus_per_node
    overlapped = cfg.asynchrony.overlapped
    engine_bundle = lambda i: i if layout.colocate else layout.train_ranks + i  # noqa: E731
    if layout.engine_servers:
        engine_bundles = [engine_bundle(e * layout.engines.gpus_per_engine) for e in range(layout.engines.num_engines)]
    else:
        engine_bundles = [engine_bundle(0)]
    if who == "rollout":
        if layout.engine_servers:  # the manager only coordinates the engine servers (tokenizes, rewards)
            return Share(index=0, count=0, pin=False)
        mine, my_bundle = ("engine", 0), engine_bundle(0)
    elif isinstance(who, int):
        mine, my_bundle = ("train", who), who
    elif who[0] == "critic":  # PPO's critic rank trains before its actor rank, on its bundle: the rank's share
        mine, my_bundle = ("train", who[1]), who[1]
    else:
        mine, my_bundle = ("engine", who[1]), engine_bundle(who[1] * layout.engines.gpus_per_engine)
    node = _node(my_bundle, device=device, gpus_per_node=per_node)
    here = lambda b: _node(b, device=device, gpus_per_node=per_node) == node  # noqa: E731
    # The processes on this node in a fixed order (ranks, then engines): the order that gives each its
    # block of cores when pinned.
    procs = [("train", r) for r in range(layout.train_ranks) if here(r)]
    engines = [("engine", i) for i, b in enumerate(engine_bundles) if here(b)]
    if overlapped:
        together = procs + engines
    else:
        together = procs if mine[0] == "train" else engines
    index = together.index(mine)
    return Share(index=index, count=len(together), pin=overlapped)


def plan(share: Share, cores: Sequence[int]) -> ThreadPlan:
    """Threads = the node's cores / the processes computing at once (at least 1); pinned to the
    `share.index`-th block of that many cores when the phases overlap and every process gets a core."""
    n = len(cores)
    if share.count == 0:
        return ThreadPlan(1, None)
    each = max(1, n // max(1, share.count))
    if not share.pin or n < share.count or not hasattr(os, "sched_setaffinity"):
        return ThreadPlan(each, None)
    ordered = sorted(cores)
    return ThreadPlan(each, tuple(ordered[share.index * each : (share.index + 1) * each]))


def user_thread_cap(environ: Mapping[str, str] = os.environ) -> int | None:
    """The user's OMP_NUM_THREADS as a cap on every actor's torch threads, or None when unset.
    A value that is not a positive integer is a `UserError` (called before anything starts)."""
    value = environ.get("OMP_NUM_THREADS", "").strip()
    if not value:
        return None
    if not value.isdigit() or int(value) < 1:
        from miles.errors import UserError

        raise UserError(
            f"OMP_NUM_THREADS={value!r}: give a positive integer (the most torch threads each miles process "
            "uses), or unset it to let miles divide the cores.",
            option="OMP_NUM_THREADS",
        )
    return int(value)


def capped(p: ThreadPlan, cap: int | None) -> ThreadPlan:
    """`p` with at most `cap` threads (pinned cores kept: a cap narrows the threads, not the cores)."""
    return p if cap is None or p.threads <= cap else ThreadPlan(cap, p.cores)


def busy_node_hint(cores: int, load: float, cap: int | None) -> str | None:
    """One line for a run starting on a busy machine (1-minute load at or above its cores) whose actors
    would take several threads each: what that costs there, and the setting that avoids it."""
    if cap is not None or cores < 2 or load < cores:
        return None
    return (
        f"note: this machine is busy (load {load:.1f} on {cores} cores). miles gives each phase all {cores} cores, "
        "and torch's threads slow down several-fold when other processes want them; "
        "OMP_NUM_THREADS=1 keeps one thread per process."
    )


def node_cores() -> list[int]:
    """The CPU ids this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def _threads() -> list[int]:
    try:
        return [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:  # no /proc: this thread only
        return [0]


def process_affinity() -> list[int]:
    """The CPU ids any thread of this process may run on (their union)."""
    if not hasattr(os, "sched_getaffinity"):
        return []
    cores: set[int] = set()
    for tid in _threads():
        try:
            cores |= os.sched_getaffinity(tid)
        except (ProcessLookupError, PermissionError):
            pass
    return sorted(cores)


def apply(p: ThreadPlan) -> ThreadPlan:
    """Pin (when the plan says so) and set torch's intra-op threads, in this process."""
    import torch

    if p.cores is not None:
        for tid in _threads():  # every thread: the affinity call moves only the thread it names, and Ray's
            try:  # threads (one of which may run the actor's methods) started before this one
                os.sched_setaffinity(tid, p.cores)
            except (ProcessLookupError, PermissionError):  # a thread that ended meanwhile
                pass
    torch.set_num_threads(p.threads)
    return p


def actor_threads(cfg: Any, who: Any) -> ThreadPlan:
    """The plan of the actor `who` of the run `cfg`, applied in this process."""
    return apply_share(share_of(cfg, who))


def apply_share(share: Share) -> ThreadPlan:
    """Plan `share` on this process's node (capped by the user's OMP_NUM_THREADS) and apply it here."""
    cap = os.environ.get(USER_CAP_ENV)
    return apply(capped(plan(share, node_cores()), int(cap) if cap else None))
