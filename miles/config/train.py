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
    )
    micro_batch_size: int = option(1, help="Samples per forward/backward pass; gradients accumulate up to --global-batch-size.")
    deterministic_mode: bool = option(
        False,
        help="Deterministic kernels and seeded RNG in the trainer, so identical runs (and resumed runs) give identical weights.",
    )
    train_memory_margin_bytes: int = option(
        1024**3,
        help="Device memory the trainer leaves free for the rollout engines when colocated.",
        unsupported="it only applies to GPU training, which this build does not run yet",
    )
