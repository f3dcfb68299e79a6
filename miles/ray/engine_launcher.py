"""`RayEngineLauncher`: the fleet's engine servers as Ray actors, one per engine, in its placement bundle.

    launcher = RayEngineLauncher(make_actor, actor_options)   # make_actor(index, seed) -> (class, args, kwargs)
    fleet = EngineFleet(launcher, num_engines=2, ...)          # miles.rollout.engine.fleet

`actor_options[i]` are engine i's Ray options (its bundle); every actor takes one CPU unless they say
otherwise and is never restarted by Ray (the fleet restarts engines itself, with fault tolerance).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

from miles.rollout.engine.fleet import EngineLauncher


class RayEngineLauncher(EngineLauncher):
    def __init__(self, make_actor: Callable[[int, int], tuple[type, tuple, dict]], actor_options: list[dict[str, Any]] | None = None):
        self.make_actor = make_actor
        self.actor_options = actor_options

    def spawn(self, index: int, seed: int):
        import ray

        actor_cls, args, kwargs = self.make_actor(index, seed)
        options = self.actor_options[index] if self.actor_options else {}
        return ray.remote(**{"num_cpus": 1, **options, "max_restarts": 0})(actor_cls).remote(*args, **kwargs)

    def started(self, handle, timeout_s: float) -> tuple[str, int]:
        import ray

        try:  # the actor's methods run once its constructor (the server's start) has returned
            return ray.get(handle.url.remote(), timeout=timeout_s), ray.get(handle.pid.remote(), timeout=60)
        except ray.exceptions.GetTimeoutError:
            raise TimeoutError(f"timed out after {timeout_s:.0f} s waiting for an engine actor to start") from None

    def kill(self, handle, timeout_s: float = 30.0) -> None:
        import ray

        try:
            ray.get(handle.stop.remote(), timeout=timeout_s)
        except Exception:  # noqa: BLE001 - a dead or hung actor: ray.kill below, and the server dies with it
            pass
        with contextlib.suppress(Exception):  # already gone
            ray.kill(handle, no_restart=True)

    def kill_all(self, handles, timeout_s: float = 30.0) -> None:
        import ray

        stops = []
        for actor in handles:
            with contextlib.suppress(Exception):  # already gone
                stops.append(actor.stop.remote())
        with contextlib.suppress(Exception):
            ray.wait(stops, num_returns=len(stops), timeout=timeout_s)
        for actor in handles:
            with contextlib.suppress(Exception):
                ray.kill(actor, no_restart=True)
