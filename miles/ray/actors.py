"""The run's Ray actor classes, one per role, named after it: what `ray._private.state.actors()` (and
`ray list actors` where the dashboard runs) shows, and what an editor follows across the Ray boundary.

- `TrainWorkerActor`: one training rank (`miles.ray.train_group.TrainWorker`, whose methods it has);
  the driver reaches all ranks through `miles.ray.train_group.TrainGroup`.
- `RolloutManagerActor`: holds the `miles.ray.rollout_manager.RolloutManager` (engine, data, rewards,
  eval) and forwards each of its methods. It holds rather than inherits: every method here is a plain
  one, so the actor stays a threaded actor even if the manager gains `async def` methods (Ray turns
  a class with any async method into an asyncio actor, where the manager's own `asyncio.run` fails).
- Engine servers are actors of their own classes (`EngineServerActor` for the built-in engine server,
  `SGLangServerActor` for SGLang), started by the rollout engine fleet.

Each class has an empty constructor and a `setup(...)` that builds the object (see miles/ray/hosting.py:
an error while it starts reaches the driver as the original `UserError`).

The driver imports this module to name the classes and must not import torch through it
(tests/ray/test_driver_imports.py): the rollout manager's module is imported by its actor's `setup`,
in the actor's own process, and `TrainWorker`'s module imports torch only inside its methods.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import ray

from miles.ray.hosting import freeze_startup_objects
from miles.ray.train_group import TrainWorker

if TYPE_CHECKING:  # imported in the actor's own process (setup): the driver defines these classes without torch
    from miles.ray.rollout_manager import RolloutManager


@ray.remote
class TrainWorkerActor(TrainWorker):
    """One training rank. Its methods are `TrainWorker`'s (start, train, offload/onload, push_weights,
    checkpoints, export); `setup` runs `TrainWorker.__init__`."""

    def __init__(self) -> None:  # noqa: D107 - built by setup(), so its errors reach the driver intact
        pass

    def setup(self, cfg, *, rank: int, world_size: int, device: str, role: str = "actor") -> int:
        TrainWorker.__init__(self, cfg, rank=rank, world_size=world_size, device=device, role=role)
        return os.getpid()


@ray.remote
class RolloutManagerActor:
    """The rollout manager of the run: `setup` builds it (engine, datasets), every other method forwards."""

    def __init__(self) -> None:
        self.manager: RolloutManager | None = None

    def setup(self, cfg, **kwargs: Any) -> int:
        from miles.ray.rollout_manager import RolloutManager

        self.manager = RolloutManager(cfg, **kwargs)
        freeze_startup_objects()  # engine, model, datasets: out of every later garbage collection
        return os.getpid()

    # -- generation and eval
    def num_prompts(self) -> int:
        return self.manager.num_prompts()

    def generate(self, rollout_id: int) -> dict[str, Any]:
        return self.manager.generate(rollout_id)

    def generate_split(self, rollout_id: int) -> tuple[dict[str, Any], dict[str, float]]:
        """Called with `num_returns=2`: the train data stays in Ray's object store for the trainers."""
        return self.manager.generate_split(rollout_id)

    def eval(self, rollout_id: int) -> dict[str, float]:
        return self.manager.eval(rollout_id)

    # -- weights and memory
    def begin_weight_update(self) -> Any:
        return self.manager.begin_weight_update()

    def load_weight_bucket(self, bucket: list | str, opens: bool = False, closes_at: int | None = None) -> None:
        return self.manager.load_weight_bucket(bucket, opens=opens, closes_at=closes_at)

    def end_weight_update(self, version: int) -> None:
        return self.manager.end_weight_update(version)

    def update_weights(self, buckets: list, version: int) -> None:
        return self.manager.update_weights(buckets, version)

    def offload(self, tags: list[str] | None = None) -> None:
        """Release the engines' memory (all of it, or the memory tags given: "weights", "kv_cache")."""
        return self.manager.offload(tags)

    def onload(self, tags: list[str] | None = None) -> None:
        """Resume the engines' memory (all of it, or the memory tags given)."""
        return self.manager.onload(tags)

    def weights_checksum(self) -> str:
        return self.manager.weights_checksum()

    def recover_engines(self) -> bool:
        return self.manager.recover_engines()

    def engine_health(self) -> dict[str, Any]:
        return self.manager.engine_health()

    def shutdown(self) -> None:
        return self.manager.shutdown()

    # -- checkpoint state
    def state_dict(self, before_rollout: int | None = None) -> dict[str, Any]:
        return self.manager.state_dict(before_rollout)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        return self.manager.load_state_dict(state)
