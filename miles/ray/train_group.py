"""The training worker group: one `TrainWorker` per training rank, each a `TrainWorkerActor`, and the
`TrainGroup` that calls every rank at once.

Each worker holds one rank of the backend that `--train-backend` names (`torch` and `fsdp`:
`miles.backends.torch.TorchBackend`, DDP or FSDP2; `megatron`: `miles.backends.megatron.MegatronTrainer`), behind
the `miles.backends.base.TrainerBackend` interface. Start-up is two calls, because the process group
must exist before a backend is built:

    group = TrainGroup.start(cfg, TrainWorkerActor, device=d, actor_options=lambda rank: {...})   # the actors, then:
    addr, port = rank 0's rendezvous_address()      # rank 0's node IP (Ray) and a port there
    every rank: start(addr, port)                   # init_process_group, build the backend

`TrainGroup` fans each call out to every rank and waits for all of them with the driver's timeouts,
naming what it waited for (a rank that dies is reported at once, see miles/ray/waiting.py).

Multi-node: the address is the IP of the node rank 0 runs on, as Ray sees it
(`ray.util.get_node_ip_address()` inside the rank-0 actor), and the port is free on that node, so
ranks on other nodes reach it; nothing assumes 127.0.0.1.

Checkpoints (`save_checkpoint`/`load_checkpoint`) and the weight-bucket stream are collectives: the
driver calls them on every worker; the weight source (rank 0) hands its buckets to the rollout side.
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Any, Callable

from miles.config.engine import EngineConfig
from miles.errors import UserError
from miles.utils.net import free_port
from miles.ray.weight_sync import SyncOrder, WeightPusher

if TYPE_CHECKING:
    from miles.backends.base import TrainerBackend

RENDEZVOUS_TIMEOUT_MIN = 10


def node_ip_address() -> str:
    """This node's IP as Ray sees it (what other nodes of the cluster reach it by); outside a Ray
    worker, the loopback address (a single-process run has no other node)."""
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except ImportError:
        pass
    return "127.0.0.1"


def make_backend(cfg: EngineConfig, *, rank: int, world_size: int, device: str, role: str = "actor") -> "TrainerBackend":
    """The `TrainerBackend` that `--train-backend` names, for one rank (of the actor or the PPO critic)."""
    if cfg.train.train_backend in ("torch", "fsdp"):  # one trainer; fsdp shards it (TorchBackend.fsdp)
        from miles.backends.torch import TorchBackend

        return TorchBackend(cfg, rank=rank, world_size=world_size, device=device, role=role)
    if cfg.train.train_backend == "megatron":
        try:
            from miles.backends.megatron import MegatronTrainer
        except ImportError as e:
            raise UserError(
                f"--train-backend megatron: the megatron backend cannot be imported ({e}); use --train-backend torch.",
                option="--train-backend",
            ) from None
        return MegatronTrainer(cfg, rank=rank, world_size=world_size, device=device, role=role)
    raise UserError(f"--train-backend {cfg.train.train_backend!r} is not one of torch, fsdp, megatron.", option="--train-backend")


class TrainWorker:
    def __init__(self, cfg: EngineConfig, *, rank: int, world_size: int, device: str, role: str = "actor"):
        from miles.ray.threads import actor_threads  # in the rank's process: the driver imports this module for TrainGroup

        # torch threads and cores: the node's cores shared with whatever computes at the same time (miles/ray/threads.py)
        self.thread_plan = actor_threads(cfg, rank if role == "actor" else ("critic", rank))
        self.cfg = cfg
        self.rank, self.world_size, self.device, self.role = rank, world_size, device, role
        self.backend: TrainerBackend | None = None
        self.weight_pusher = WeightPusher()  # its sender (a broadcast group, a tensor buffer) outlives a sync

    def threads(self) -> tuple[int, list[int]]:
        """(torch's intra-op threads, the CPU ids any thread of this process may run on), as the rank runs."""
        import torch

        from miles.ray.threads import process_affinity

        return torch.get_num_threads(), process_affinity()

    def rendezvous_address(self) -> tuple[str, int]:
        """(this node's IP, a port free on this node): called on rank 0 only."""
        return node_ip_address(), free_port()

    def start(self, master_addr: str, master_port: int) -> bool:
        """Join the process group at rank 0's address (when there is more than one rank), then build
        the backend."""
        if self.world_size > 1:
            import datetime

            import torch.distributed as dist

            os.environ.update(MASTER_ADDR=master_addr, MASTER_PORT=str(master_port))
            dist.init_process_group(
                "nccl" if self.device == "cuda" else "gloo",
                rank=self.rank,
                world_size=self.world_size,
                timeout=datetime.timedelta(minutes=RENDEZVOUS_TIMEOUT_MIN),
            )
        self.backend = make_backend(self.cfg, rank=self.rank, world_size=self.world_size, device=self.device, role=self.role)
        from miles.ray.hosting import freeze_startup_objects

        freeze_startup_objects()  # model, optimizer, imports: out of every later garbage collection
        return True

    def parameter_metrics(self) -> dict[str, float]:
        return self.backend.parameter_metrics()

    def train(
        self, train_data: dict[str, Any], rollout_id: int, critic: dict[str, Any] | None = None, push: "SyncOrder | None" = None
    ) -> dict[str, float]:
        """The policy's step; `critic`: what the critic rank of the same index returned (ppo). `push`: then
        the weight sync too, in this call (miles.ray.weight_sync.order_with_train), timed as perf/weight_sync_time."""
        from miles.train.step import train_rollout

        metrics = train_rollout(self.backend, train_data, rollout_id=rollout_id, values=None if critic is None else critic["values"])
        if push is not None:
            t0 = time.perf_counter()
            metrics = {**metrics, **self.push_weights(push)}
            metrics["perf/weight_sync_time"] = time.perf_counter() - t0
        return metrics

    def train_critic(self, train_data: dict[str, Any], rollout_id: int) -> dict[str, Any]:
        """The critic's step: {"metrics": critic/*, "values": its pre-update values by sample index}."""
        from miles.train.step import train_critic

        metrics, values = train_critic(self.backend, train_data, rollout_id=rollout_id)
        return {"metrics": metrics, "values": values}

    def offload(self) -> None:
        """--offload-train: weights and optimizer state to host memory while the engine generates."""
        self.backend.offload()

    def onload(self) -> None:
        self.backend.onload()

    # -- weights to the rollout engines --------------------------------------------------------------
    def push_weights(self, order: "SyncOrder") -> dict[str, float]:
        """Every rank: iterate the weight buckets; the source rank sends them to the engines (miles/ray/weight_sync.py)."""
        return self.weight_pusher.push(self.backend, order)

    def weights_checksum(self) -> str:
        return self.backend.weights_checksum()

    # -- checkpoints ---------------------------------------------------------------------------------
    def save_checkpoint(self, directory: str) -> None:
        self.backend.save_checkpoint(directory)

    def load_checkpoint(self, directory: str) -> None:
        self.backend.load_checkpoint(directory)

    def export_hf(self, out_dir: str) -> str | None:
        """Write the weights as a Hugging Face directory (every rank takes part; the weight source writes)."""
        from miles.ckpt.hf_export import export_hf

        weights = {name: t.detach().cpu() for bucket in self.backend.iter_weight_buckets(1 << 30) for name, t in bucket}
        if not self.backend.is_weight_source:
            return None
        return str(export_hf(weights, self.cfg.rollout.hf_checkpoint, out_dir))


class TrainGroup:
    """Every training rank of the run, called as one: each method calls the same method on every
    `TrainWorkerActor` and waits for all of them (the driver's timeouts, a sentence naming the wait)."""

    def __init__(self, actors: list, *, step_timeout_s: float | None = None):
        from miles.ray.waiting import STEP_TIMEOUT_S

        self.actors = actors  # HostedActor per rank (miles/ray/hosting.py)
        self.handles = [a.handle for a in actors]
        self.step_timeout_s = STEP_TIMEOUT_S if step_timeout_s is None else step_timeout_s

    @classmethod
    def start(cls, cfg: EngineConfig, actor_class, *, device: str, actor_options: Callable[[int], dict[str, Any]],
              role: str = "actor") -> "TrainGroup":
        """Start one `actor_class` (`miles.ray.actors.TrainWorkerActor`) per rank, rendezvous at rank 0's
        node (its IP as Ray sees it, a port free there), then build the backends (every rank loads the model).
        `role="critic"`: PPO's critic group, the same ranks with a value model (its own process group)."""
        from miles.ray.hosting import start_actor
        from miles.ray.waiting import ACTOR_START_TIMEOUT_S, wait

        world = cfg.layout.train_ranks
        who = "training" if role == "actor" else "critic"
        actors = [
            start_actor(actor_class, cfg, rank=r, world_size=world, device=device, role=role,
                        label=f"the {'TrainWorker' if role == 'actor' else 'critic TrainWorker'} of rank {r}",
                        actor_options=actor_options(r))
            for r in range(world)
        ]
        wait([a.ready_ref for a in actors], f"the {who} workers to start", ACTOR_START_TIMEOUT_S)
        group = cls(actors)
        master = wait(group.handles[0].rendezvous_address.remote(), f"{who} rank 0 to pick the rendezvous address")
        group._all([h.start.remote(*master) for h in group.handles], f"the {who} workers to join and load the model", ACTOR_START_TIMEOUT_S)
        return group

    def _all(self, refs: list, what: str, timeout: float | None = None) -> list:
        from miles.ray.waiting import wait

        return wait(refs, what, self.step_timeout_s if timeout is None else timeout)

    def train(self, data_ref, rollout_id: int, critic_refs: list | None = None, push: "SyncOrder | None" = None) -> dict[str, float]:
        """One RL step on every rank; rank 0's metrics (they are reduced across ranks already).
        `critic_refs`: per rank, the critic rank's `train_critic` result (ppo), passed by reference.
        `push`: every rank then runs that weight sync in the same call (`TrainWorker.train`)."""
        refs = critic_refs or [None] * len(self.handles)
        what = f"training on rollout {rollout_id}" + (f" and sending weights (version {push.version})" if push else "")
        return self._all([h.train.remote(data_ref, rollout_id, c, push) for h, c in zip(self.handles, refs)], what)[0]

    def train_critic(self, data_ref, rollout_id: int) -> tuple[dict[str, float], list]:
        """The critic's step on every rank: (rank 0's critic/* metrics, each rank's result by reference,
        which carries its values to the actor rank of the same index without passing through here)."""
        refs = [h.train_critic.remote(data_ref, rollout_id) for h in self.handles]
        self._all(list(refs), f"the critic's training on rollout {rollout_id}")
        return self._all(refs[0], f"the critic's metrics of rollout {rollout_id}")["metrics"], refs

    def parameter_metrics(self) -> dict[str, float]:
        """Rank 0's parameter counts and optimizer memory (`TrainerBackend.parameter_metrics`)."""
        return self._all([self.handles[0].parameter_metrics.remote()], "training rank 0 to count its parameters")[0]

    def offload(self) -> None:
        self._all([h.offload.remote() for h in self.handles], "the trainer to move to host memory")

    def onload(self) -> None:
        self._all([h.onload.remote() for h in self.handles], "the trainer to move back to the device")

    def weights_checksum(self) -> str:
        """The trainer's checksum (a collective: every rank takes part; rank 0's answer)."""
        return self._all([h.weights_checksum.remote() for h in self.handles], "the trainer's weight checksum")[0]

    def save_checkpoint(self, directory: str) -> None:
        self._all([h.save_checkpoint.remote(directory) for h in self.handles], f"the training workers to write their checkpoint shards into {directory}")

    def load_checkpoint(self, directory: str) -> None:
        self._all([h.load_checkpoint.remote(directory) for h in self.handles], f"the training workers to load {directory}")

    def export_hf(self, out_dir: str) -> None:
        self._all([h.export_hf.remote(out_dir) for h in self.handles], "the Hugging Face export")
