"""The trainer interface: `PackedBatch` (what a loss sees) and `TrainerBackend` (one rank's compute primitives).

The RL step (`miles.train.step.train_rollout`) is written once, above the backends: it cuts a rollout
into optimizer steps and micro-batches, asks a backend for the forwards it needs, computes advantages
and the loss from `miles.algo`, and steps the optimizer through this interface. A backend (torch:
`miles.backends.torch.TorchBackend`; megatron: `miles.backends.megatron.MegatronTrainer`) only
computes: forwards, forward-backward with a loss it is given, an optimizer step at a given lr, metric
and data-parallel reductions, checkpoints, offload and weight buckets. It holds no RL logic.

Batches are packed: the tokens of B samples are concatenated into one stream with cumulative sequence
lengths, and every per-token training quantity (loss mask, advantages, log-probs) is a flat [R] tensor
over the response tokens of those samples, in sample order. `miles.algo` reduces over samples with
segment reductions on `response_cu_seqlens` / `sample_index_of_token`.

Build a `PackedBatch` from the rollout's per-sample train data with
`miles.train.packing.pack_samples(train_data, indices, device)`.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterator, Literal

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
    old_values: torch.Tensor | None = None
    """float32 [R]: the critic's values before this rollout's update (PPO's value clip is around them)."""
    teacher_log_probs: torch.Tensor | None = None
    """float32 [R]: `--use-opd`'s teacher log-probs of the response tokens (from its engine, or the
    trainer's teacher forward)."""

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


LossFn = Callable[[PackedBatch, torch.Tensor, "torch.Tensor | None"], torch.Tensor]
"""`loss_fn(batch, log_probs, entropy) -> loss`: the scalar loss of one micro-batch, already divided by the
whole global batch's normaliser (so the gradients of all micro-batches add up to the global batch's).
It runs once per micro-batch, on the ranks that see the model's output (megatron: the last PP stage).
A critic backend (`role == "critic"`) passes its values [R] (with gradient) in place of the log-probs
and None for the entropy."""


class TrainerBackend(abc.ABC):
    """One rank of a training backend: compute primitives for `miles.train`.

    The caller (miles/ray/train_group.TrainWorker) has already initialised torch.distributed (gloo on
    CPU / NCCL on GPU) when world_size > 1. Every method marked collective must be called on every
    rank, in the same order.
    """

    cfg: "EngineConfig"
    device: str
    is_weight_source: bool
    """True on the one rank that sends weights to the rollout engines (never on a critic)."""
    role: Literal["actor", "critic"] = "actor"
    """"critic": PPO's value model (the policy's architecture with a scalar value head): `values()`
    instead of `forward()`, and `forward_backward` gives the loss values instead of log-probs."""

    def __init__(
        self, cfg: "EngineConfig", *, rank: int, world_size: int, device: str, role: Literal["actor", "critic"] = "actor"
    ): ...

    # --- data parallelism --------------------------------------------------------------------------
    @property
    @abc.abstractmethod
    def dp_rank(self) -> int:
        """This rank's index in the data-parallel group (which slice of each global batch it trains)."""

    @property
    @abc.abstractmethod
    def dp_size(self) -> int:
        """The data-parallel group's size (TP/PP/CP ranks of one replica share a dp_rank)."""

    @abc.abstractmethod
    def all_reduce_dp(self, t: torch.Tensor) -> torch.Tensor:
        """Collective: sum `t` in place over the data-parallel group and return it."""

    @abc.abstractmethod
    def all_reduce_metrics(self, local: dict[str, float]) -> dict[str, float]:
        """Collective: one step's metrics over the data-parallel group (`*_max` by max, `*_min` by min,
        the rest by sum), the same dict on every rank (megatron: the last PP stage's, broadcast)."""

    # --- forwards ----------------------------------------------------------------------------------
    @property
    @abc.abstractmethod
    def has_reference(self) -> bool:
        """A frozen reference model is loaded (it is when a KL term needs its log-probs)."""

    @property
    def has_teacher(self) -> bool:
        """An on-policy distillation teacher is loaded (`--use-opd --opd-type megatron`): `forward(model="teacher")`."""
        return False

    @abc.abstractmethod
    def forward(
        self, batches: list[PackedBatch], *, model: Literal["actor", "ref", "teacher"] = "actor", with_entropy: bool = False
    ) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """Collective, no grad: per micro-batch, log-probs [R] (and entropy [R]) of its response tokens,
        with the logits divided by cfg.rollout.rollout_temperature (upstream's rule, so the trainer
        and the engine score the same policy). Every rank (every PP stage) gets the results.
        `model="teacher"`: the OPD teacher (`has_teacher`)."""

    def compute_log_probs(
        self, batch: PackedBatch, *, model: Literal["actor", "ref"] = "actor", with_entropy: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`forward` of one batch (it runs as one forward: pack micro-batch-sized batches for big rollouts)."""
        return self.forward([batch], model=model, with_entropy=with_entropy)[0]

    def values(self, batches: list[PackedBatch]) -> list[torch.Tensor]:
        """Collective, no grad: a critic's value [R] of every response token (read at the position
        before it, like log-probs), per micro-batch; only on a backend built with role="critic"."""
        raise NotImplementedError(f"this {type(self).__name__} is not a critic (role={self.role!r}); build one with role='critic'")

    # --- training ----------------------------------------------------------------------------------
    @abc.abstractmethod
    def forward_backward(
        self, batches: list[PackedBatch], loss_fn: LossFn, *, with_entropy: bool, entropy_grad: bool
    ) -> None:
        """Collective: zero the gradients, then forward and backward every micro-batch of one optimizer
        step with `loss_fn`, accumulating gradients (and reducing them over data parallelism as a
        sum). `entropy_grad`: gradients flow through the entropy (only when it is in the loss)."""

    @property
    @abc.abstractmethod
    def num_optimizer_steps(self) -> int:
        """Optimizer steps taken so far (skipped steps do not count): the LR schedule's whole state,
        saved with the checkpoint."""

    @abc.abstractmethod
    def optimizer_step(self, lr: float) -> tuple[float, bool]:
        """Collective: clip (--clip-grad) and step at learning rate `lr`; returns (global grad norm,
        whether the step was taken). A non-finite gradient skips the step and drops the gradients."""

    # --- state -------------------------------------------------------------------------------------
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

    def parameter_metrics(self) -> dict[str, float]:
        """`train/trainable_params`, `train/total_params`, `train/trainable_share` and
        `train/optimizer_state_bytes` (this rank's optimizer state) where the backend counts them
        (the start-up line and every step's metrics); {} where it does not."""
        return {}

    @abc.abstractmethod
    def weights_checksum(self) -> str:
        """Over the HF-named full weights, same on every rank."""
