"""The training worker group: one `TrainWorker` per data-parallel rank, as Ray actors.

Every rank holds a `TorchTrainer` over the same weights; with more than one rank they form a gloo
(CPU) or NCCL (GPU) process group and average gradients, so every rank ends each step with identical
weights. Rank 0 answers for the group when weights or state are read.
"""

from __future__ import annotations

import os
import socket
from typing import Any

import torch

from miles.config.engine import EngineConfig
from miles.rollout.engine.base import iter_weight_buckets


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TrainWorker:
    def __init__(self, cfg: EngineConfig, *, rank: int, world_size: int, master_port: int, device: str, threads: int = 1):
        torch.set_num_threads(threads)
        self.rank, self.world_size = rank, world_size
        if world_size > 1:
            import datetime

            import torch.distributed as dist

            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(master_port))
            dist.init_process_group(
                "nccl" if device == "cuda" else "gloo",
                rank=rank,
                world_size=world_size,
                timeout=datetime.timedelta(minutes=10),
            )
        from miles.backends.torch.trainer import TorchTrainer

        self.cfg = cfg
        if cfg.train.train_backend == "megatron":  # a TrainerBackend (miles/backends/base.py)
            from miles.backends.megatron.trainer import MegatronTrainer
            self.trainer = MegatronTrainer(cfg, rank=rank, world_size=world_size, device=device)
            return
        self.trainer = TorchTrainer(
            cfg.rollout.hf_checkpoint,
            optimizer_cfg=cfg.optimizer,
            algo_cfg=cfg.algo,
            micro_batch_size=cfg.train.micro_batch_size,
            deterministic=cfg.train.deterministic_mode,
            seed=cfg.optimizer.seed,
            device=device,
            dp_rank=rank,
            dp_world_size=world_size,
            ref_hf_dir=cfg.ckpt.ref_load,
        )

    def train(self, train_data: dict[str, Any], rollout_id: int) -> dict[str, float]:
        d = self.cfg.data
        return self.trainer.train_step(
            train_data,
            rollout_id=rollout_id,
            global_batch_size=d.global_batch_size,
            num_steps_per_rollout=d.num_steps_per_rollout,
            n_samples_per_prompt=d.n_samples_per_prompt,
        )

    def offload(self) -> None:
        """--offload-train: weights and optimizer state to host memory while the engine generates."""
        self._move("cpu")

    def onload(self) -> None:
        self._move(self.trainer.device)

    def _move(self, device: str) -> None:
        if self.trainer.device == "cpu":
            return  # already in host memory
        for net in (self.trainer.model, self.trainer.ref_model):
            if net is not None:
                net.to(device)
        for state in self.trainer.optimizer.state.values():
            for key, value in state.items():
                if torch.is_tensor(value) and value.dim() > 0:
                    state[key] = value.to(device)
        if device == "cpu":
            torch.cuda.empty_cache()

    def plan_weight_buckets(self, bucket_bytes: int) -> int:
        """Group the weights (Hugging Face names) into buckets of at most `bucket_bytes`; returns how many."""
        buckets = iter_weight_buckets(self.trainer.named_weights_for_sync(), bucket_bytes)
        self._bucket_names = [[name for name, _ in bucket] for bucket in buckets]
        return len(self._bucket_names)

    def weight_bucket(self, index: int) -> list[tuple[str, torch.Tensor]]:
        """A host-memory copy of bucket `index` only, so one bucket at a time is in flight."""
        weights = dict(self.trainer.named_weights_for_sync())
        return [(name, weights[name].detach().clone().cpu()) for name in self._bucket_names[index]]

    def weights_checksum(self) -> str:
        from miles.rollout.engine.base import weights_checksum

        return weights_checksum(self.trainer.named_weights_for_sync())

    def state_dict(self) -> dict[str, Any]:
        import copy

        return copy.deepcopy(self.trainer.state_dict())

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.trainer.load_state_dict(state)

    def export_hf(self, out_dir: str) -> str:
        from miles.ckpt.hf_export import export_hf

        return str(export_hf(dict(self.trainer.named_weights_for_sync()), self.cfg.rollout.hf_checkpoint, out_dir))
