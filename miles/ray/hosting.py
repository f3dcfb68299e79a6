"""Start the run's Ray actors so that their errors reach the driver intact, and end them when it stops.

Every actor class of the run (miles/ray/actors.py) has an empty constructor and a `setup(...)` method
that builds what it holds: Ray reports an exception raised in an actor's constructor only as text
(`ActorDiedError`), which would turn a user mistake found while a worker starts (a bad dataset row, a
hook path that does not import) into a traceback; raised in `setup`, it travels as a task error whose
`cause` is the original exception, and the driver's `wait()` re-raises a `UserError` as itself.

    actor = start_actor(TrainWorkerActor, cfg, rank=0, world_size=1, device="cpu", label="the TrainWorker of rank 0")
    wait(actor.ready_ref, ...)                       # the pid, once `setup` returned
    wait(actor.handle.train.remote(data_ref, 0), ...)   # a typed method call
"""

from __future__ import annotations

import dataclasses
from typing import Any

_HOSTED: list["HostedActor"] = []  # every actor started in this process, so a stopping run can end them


@dataclasses.dataclass
class HostedActor:
    """A started actor: its Ray handle, the reference `setup` resolves (the actor's pid, or its error)
    and what it is, for the sentence when it dies."""

    handle: Any
    ready_ref: Any
    label: str


def actor_label(actor_id: str | None) -> str | None:
    """What the actor with this id is ("the TrainWorker of rank 1", "the RolloutManager"), if started here."""
    if not actor_id:
        return None
    return next((a.label for a in _HOSTED if a.handle._actor_id.hex() == actor_id), None)


def hosted_actors() -> list[HostedActor]:
    return list(_HOSTED)


def start_actor(cls: Any, *args: Any, label: str, actor_options: dict[str, Any] | None = None, **kwargs: Any) -> HostedActor:
    """Create an actor of the Ray actor class `cls` with `actor_options` and call its `setup(*args, **kwargs)`."""
    handle = cls.options(**(actor_options or {})).remote()
    hosted = HostedActor(handle, handle.setup.remote(*args, **kwargs), label)
    _HOSTED.append(hosted)
    return hosted


def freeze_startup_objects() -> None:
    """Move every object alive now (imported modules, the model, the engine, the datasets) out of
    Python's cyclic garbage collector's view (`gc.freeze`), after one last collection. Call once a
    process has finished setting up. Every full collection otherwise walks the millions of objects
    torch and transformers leave behind: in the rollout manager, whose per-sample Python objects
    trigger collections all the time, that was ~25 ms per rollout of the default run (in-process
    measurement; 2 ms after freezing). Objects made later are collected as before; what is frozen
    is never freed by a collection, which is what start-up objects of a run's process are anyway."""
    import gc

    gc.collect()
    gc.freeze()


def end_hosted_actors() -> list[int]:
    """`ray.kill` every actor started here (a busy actor does not stop when Ray's node shuts down: it
    would outlive the run); returns the pids they reported, for the caller to make sure they are gone."""
    import ray

    pids = []
    for actor in _HOSTED:
        try:
            pids.append(int(ray.get(actor.ready_ref, timeout=1)))
        except Exception:
            pass  # never started, or its setup failed: nothing reported
        try:
            ray.kill(actor.handle, no_restart=True)
        except Exception:
            pass
    _HOSTED.clear()
    return pids


def unwrap_user_error(error: BaseException) -> BaseException | None:
    """The `UserError` inside a Ray task error, if that is what it carries."""
    from ray.exceptions import RayTaskError

    from miles.errors import UserError

    seen = 0
    while error is not None and seen < 5:
        if isinstance(error, UserError) and not isinstance(error, RayTaskError):
            return error
        error = getattr(error, "cause", None)
        seen += 1
    return None
