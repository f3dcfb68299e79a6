"""Training options: which trainer runs and how its batches are cut."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from miles.config.fields import option


@dataclass
class TrainConfig:
    train_backend: Literal["torch", "megatron"] = option(
        "torch",
        help="Trainer: torch (CPU or GPU, data parallel) or megatron (megatron-core: TP/PP/CP/EP).",
        unavailable={"megatron": "the megatron-core trainer is not built yet; miles convert already writes its torch_dist checkpoints"},
    )
    micro_batch_size: int = option(1, help="Samples per forward/backward pass; gradients accumulate up to --global-batch-size.")
    deterministic_mode: bool = option(
        False,
        help="Deterministic kernels and seeded RNG in the trainer, so identical runs (and resumed runs) give identical weights.",
        # What deterministic kernels need from the environment: cuBLAS refuses deterministic matmuls
        # without a fixed workspace, NCCL's tree/ring choice changes reduction order, and
        # TransformerEngine picks non-deterministic kernels unless told not to.
        run_env={"CUBLAS_WORKSPACE_CONFIG": ":4096:8", "NCCL_ALGO": "Ring", "NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0"},
    )
    train_memory_margin_bytes: int = option(
        1024**3,
        help="Device memory the trainer leaves free for the rollout engines when colocated.",
        unsupported="it only applies to GPU training, which this build does not run yet",
    )
