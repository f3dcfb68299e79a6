"""Segments of a packed per-token tensor: which of the R response tokens belong to which sample.

Every loss and estimator in `miles.algo` takes flat [R] tensors (the response tokens of B samples
concatenated, as in `miles.backends.base.PackedBatch`) plus a `Segments` built from the response
cumulative lengths. Per-sample quantities are computed with segment reductions (`index_add`,
`scatter_reduce`) and broadcast back with one gather, so no Python loop runs over samples.

Use: `seg = Segments.from_lengths([3, 2, 0])`; `seg.sum(x * mask)` -> [B]; `seg.broadcast(v)` -> [R];
`seg.split(x)` -> list of per-sample tensors (for tests and metrics, not for hot paths).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class Segments:
    cu_seqlens: torch.Tensor
    """int64 [B+1]: sample b owns the [R] positions cu_seqlens[b]:cu_seqlens[b+1]."""
    index: torch.Tensor = field(init=False)
    """int64 [R]: the sample of every position."""

    def __post_init__(self) -> None:
        lengths = self.cu_seqlens[1:] - self.cu_seqlens[:-1]
        object.__setattr__(
            self, "index", torch.repeat_interleave(torch.arange(lengths.numel(), device=lengths.device), lengths)
        )

    @classmethod
    def from_lengths(cls, lengths: Sequence[int] | torch.Tensor, device: str | torch.device | None = None) -> "Segments":
        lengths = torch.as_tensor(lengths, dtype=torch.int64, device=device)
        cu = torch.zeros(lengths.numel() + 1, dtype=torch.int64, device=lengths.device)
        torch.cumsum(lengths, 0, out=cu[1:])
        return cls(cu)

    @property
    def num_segments(self) -> int:
        return self.cu_seqlens.numel() - 1

    @property
    def num_tokens(self) -> int:
        return int(self.index.numel())

    @property
    def lengths(self) -> torch.Tensor:
        return self.cu_seqlens[1:] - self.cu_seqlens[:-1]

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        """[B]: the sum of `x` [R] over each sample (0 for an empty sample); differentiable."""
        return x.new_zeros(self.num_segments).index_add(0, self.index, x)

    def amax(self, x: torch.Tensor, *, empty: float = float("-inf")) -> torch.Tensor:
        """[B]: max of `x` [R] over each sample; `empty` where a sample has no position."""
        # The initial value takes part in the reduction; -inf never wins a max, so it only shows
        # where a sample has no position, and is then replaced by `empty`.
        lowest = float("-inf") if x.is_floating_point() else torch.iinfo(x.dtype).min
        out = x.new_full((self.num_segments,), lowest).scatter_reduce(0, self.index, x, reduce="amax")
        return torch.where(self.lengths > 0, out, torch.full_like(out, empty))

    def amin(self, x: torch.Tensor, *, empty: float = float("inf")) -> torch.Tensor:
        """[B]: min of `x` [R] over each sample; `empty` where a sample has no position."""
        return -self.amax(-x, empty=-empty)

    def broadcast(self, per_sample: torch.Tensor) -> torch.Tensor:
        """[R]: every position gets its sample's value."""
        return per_sample[self.index]

    def rank_in_segment(self, mask: torch.Tensor) -> torch.Tensor:
        """int64 [R]: at masked-in positions, how many masked-in positions of the same sample come before."""
        running = torch.cumsum(mask.to(torch.int64), 0)
        before_sample = torch.cat([running.new_zeros(1), running])[self.cu_seqlens[:-1]]
        return running - 1 - before_sample[self.index]

    def split(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Per-sample views of `x` [R] (for tests and reporting)."""
        return list(x.split(self.lengths.tolist()))


def pack(tensors: Sequence[torch.Tensor]) -> tuple[torch.Tensor, Segments]:
    """Concatenate per-sample 1-D tensors into [R] and describe their segments (tests, custom code)."""
    flat = torch.cat([t.reshape(-1) for t in tensors]) if tensors else torch.zeros(0)
    return flat, Segments.from_lengths([t.numel() for t in tensors])
