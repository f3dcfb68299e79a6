"""The trainer interface: `PackedBatch` (what a loss sees) and `TrainerBackend` (one rank of a trainer).

The driver and the rollout side talk to "a trainer" only through `TrainerBackend`; the torch backend
(`miles.backends.torch.TorchBackend`) and the megatron backend (`miles.backends.megatron`) implement it.
Batches are packed: the tokens of B samples are concatenated into one stream with cumulative sequence
lengths, and every per-token training quantity (loss mask, advantages, log-probs) is a flat [R] tensor
over the response tokens of those samples, in sample order. `miles.algo` reduces over samples with
segment reductions on `response_cu_seqlens` / `sample_index_of_token`.

Build a `PackedBatch` from the rollout's per-sample train data with
`miles.backends.packing.pack_samples(train_data, indices, device)`.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator, Literal

import torch

if TYPE_CHECKING:
    from miles.config.engine import EngineConfig


@dataclass
class PackedBatch:
    """B samples packed into one token stream; everything on the trainer's device."""

    tokens: torch.Tensor
    """int64 [T]: prompt+response tokens of the B samples concatenated."""
    cu_seqlens: torch.Tensor
    """int64 [B+1]: sample b is tokens[cu_seqlens[b]:cu_seqlens[b+1]]."""
    response_lengths: torch.Tensor
    """int64 [B]: the last response_lengths[b] tokens of sample b are its response."""
    loss_mask: torch.Tensor
    """float32 [R], R = response_lengths.sum(): 1 where a response token is trained."""
    advantages: torch.Tensor | None = None
    returns: torch.Tensor | None = None
    rollout_log_probs: torch.Tensor | None = None
    old_log_probs: torch.Tensor | None = None
    ref_log_probs: torch.Tensor | None = None

    @property
    def num_samples(self) -> int:
        return int(self.response_lengths.numel())

    @property
    def response_cu_seqlens(self) -> torch.Tensor:
        """int64 [B+1]: sample b's response tokens are [R] positions response_cu_seqlens[b]:[b+1]."""
        out = torch.zeros(self.num_samples + 1, dtype=torch.int64, device=self.response_lengths.device)
        torch.cumsum(self.response_lengths, 0, out=out[1:])
        return out

    @property
    def sample_index_of_token(self) -> torch.Tensor:
        """int64 [R]: the sample each response token belongs to."""
        return torch.repeat_interleave(
            torch.arange(self.num_samples, device=self.response_lengths.device), self.response_lengths
        )


class TrainerBackend(abc.ABC):
    """One rank of a training backend. The caller (miles/ray/train_group.TrainWorker) has already
    initialised torch.distributed (gloo on CPU / NCCL on GPU) when world_size > 1."""

    is_weight_source: bool
    """True on the one rank that sends weights to the rollout engines."""

    def __init__(self, cfg: "EngineConfig", *, rank: int, world_size: int, device: str): ...

    @abc.abstractmethod
    def compute_log_probs(
        self, batch: PackedBatch, *, model: Literal["actor", "ref"] = "actor", with_entropy: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Per-response-token log-probs [R] (and entropy [R]) of the batch's response tokens, no grad,
        with the logits divided by cfg.rollout.rollout_temperature (upstream's rule, so the trainer
        and the engine score the same policy)."""

    @abc.abstractmethod
    def train_step(self, train_data: dict, *, rollout_id: int) -> dict[str, float]:
        """One rollout's optimizer steps (num_steps_per_rollout x global_batch_size); train/* and perf/* metrics."""

    @abc.abstractmethod
    def offload(self) -> None: ...

    @abc.abstractmethod
    def onload(self) -> None: ...

    @abc.abstractmethod
    def save_checkpoint(self, directory: str) -> None:
        """Collective: every rank writes its own shard of model + optimizer + RNG + scheduler state
        (torch: torch.distributed.checkpoint; megatron: dist_checkpointing torch_dist) into `directory`,
        which the caller created as the temporary dir of the atomic tracker protocol
        (miles/ckpt/trainer_checkpoint.py) and renames after every rank returned."""

    @abc.abstractmethod
    def load_checkpoint(self, directory: str) -> None:
        """Collective: restore what `save_checkpoint` wrote (every rank reads its own shard)."""

    @abc.abstractmethod
    def iter_weight_buckets(self, bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Collective: every rank must iterate to the end (TP shards are all-gathered, PP stages each
        contribute their own layers, experts gathered). Yields Hugging Face-named full tensors in
        buckets of at most bucket_bytes; on ranks that are not the weight source
        (`self.is_weight_source` False) it yields the same number of buckets but they may be empty."""

    @abc.abstractmethod
    def weights_checksum(self) -> str:
        """Over the HF-named full weights, same on every rank."""
