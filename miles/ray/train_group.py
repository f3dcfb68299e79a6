"""The training worker group: one `TrainWorker` per training rank, as Ray actors.

Each worker holds one rank of the backend that `--train-backend` names (`torch` and `fsdp`:
`miles.backends.torch.TorchBackend`, DDP or FSDP2; `megatron`: `miles.backends.megatron.MegatronTrainer`), behind
the `miles.backends.base.TrainerBackend` interface. Start-up is two calls, because the process group
must exist before a backend is built:

    workers = [remote_object(TrainWorker, cfg, rank=r, world_size=n, device=d) for r in range(n)]
    addr, port = wait(workers[0].rendezvous_address.remote())   # rank 0's node IP (Ray) and a port there
    wait([w.start.remote(addr, port) for w in workers])         # init_process_group, build the backend

Multi-node: the address is the IP of the node rank 0 runs on, as Ray sees it
(`ray.util.get_node_ip_address()` inside the rank-0 actor), and the port is free on that node, so
ranks on other nodes reach it; nothing assumes 127.0.0.1.

Checkpoints (`save_checkpoint`/`load_checkpoint`) and the weight-bucket stream are collectives: the
driver calls them on every worker; the weight source (rank 0) hands its buckets to the rollout side.
"""

from __future__ import annotations

import os
import socket
from typing import TYPE_CHECKING, Any

import torch

from miles.config.engine import EngineConfig
from miles.errors import UserError

if TYPE_CHECKING:
    from miles.backends.base import TrainerBackend

RENDEZVOUS_TIMEOUT_MIN = 10


def free_port(host: str = "") -> int:
    """A TCP port that is free on this node right now (bound on all interfaces, then released)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


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


def make_backend(cfg: EngineConfig, *, rank: int, world_size: int, device: str) -> "TrainerBackend":
    """The `TrainerBackend` that `--train-backend` names, for one rank."""
    if cfg.train.train_backend in ("torch", "fsdp"):  # one trainer; fsdp shards it (TorchBackend.fsdp)
        from miles.backends.torch import TorchBackend

        return TorchBackend(cfg, rank=rank, world_size=world_size, device=device)
    if cfg.train.train_backend == "megatron":
        try:
            from miles.backends.megatron import MegatronTrainer
        except ImportError as e:
            raise UserError(
                f"--train-backend megatron: the megatron backend cannot be imported ({e}); use --train-backend torch.",
                option="--train-backend",
            ) from None
        return MegatronTrainer(cfg, rank=rank, world_size=world_size, device=device)
    raise UserError(f"--train-backend {cfg.train.train_backend!r} is not one of torch, fsdp, megatron.", option="--train-backend")


class TrainWorker:
    def __init__(self, cfg: EngineConfig, *, rank: int, world_size: int, device: str, threads: int = 1):
        torch.set_num_threads(threads)
        self.cfg = cfg
        self.rank, self.world_size, self.device = rank, world_size, device
        self.backend: TrainerBackend | None = None

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
        self.backend = make_backend(self.cfg, rank=self.rank, world_size=self.world_size, device=self.device)
        return True

    def parameter_metrics(self) -> dict[str, float]:
        return self.backend.parameter_metrics()

    def train(self, train_data: dict[str, Any], rollout_id: int) -> dict[str, float]:
        from miles.train.step import train_rollout

        return train_rollout(self.backend, train_data, rollout_id=rollout_id)

    def offload(self) -> None:
        """--offload-train: weights and optimizer state to host memory while the engine generates."""
        self.backend.offload()

    def onload(self) -> None:
        self.backend.onload()

    # -- weights to the rollout engines --------------------------------------------------------------
    def push_weights(self, targets: dict[str, Any], version: int) -> dict[str, float]:
        """Every rank: iterate the weight buckets; the source rank sends them to the engines (miles/ray/weight_sync.py)."""
        from miles.ray.weight_sync import push_weights

        return push_weights(self, targets, version)

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
