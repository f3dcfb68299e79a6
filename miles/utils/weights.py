"""Weights as (Hugging Face name, tensor) pairs: their size, their buckets, their checksum.

Below every layer: trainers cut their weights into buckets with `iter_weight_buckets` and the
engines that receive them, the trainers and `--check-weight-update-equal` compare `weights_checksum`s.
torch is imported only inside the functions that need it.
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Iterable, Iterator

if TYPE_CHECKING:
    import torch


def tensor_nbytes(t: "torch.Tensor") -> int:
    return t.numel() * t.element_size()


def iter_weight_buckets(
    named_tensors: Iterable[tuple[str, "torch.Tensor"]], bucket_bytes: int
) -> Iterator[list[tuple[str, "torch.Tensor"]]]:
    """Group (name, tensor) pairs, in order, into buckets of at most `bucket_bytes` bytes each.

    A tensor larger than `bucket_bytes` travels alone in its own bucket (it cannot be split: the
    receiver copies whole parameters). Lazy: tensors are pulled from `named_tensors` one at a time, so
    a generator that gathers parameters on demand keeps at most one bucket alive.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket size must be positive (--update-weight-buffer-size), got {bucket_bytes}")
    bucket: list[tuple[str, "torch.Tensor"]] = []
    size = 0
    for name, tensor in named_tensors:
        nbytes = tensor_nbytes(tensor)
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket


def weights_checksum(named_tensors: Iterable[tuple[str, "torch.Tensor"]]) -> str:
    """SHA-256 over sorted (name, dtype, shape, raw bytes): equal iff every tensor is bit-identical.

    Names are sorted so trainer and engine agree whatever order they iterate in; a name listed twice
    (tied weights exposed under two names) is hashed once.
    """
    import torch

    seen: dict[str, torch.Tensor] = {}
    for name, t in named_tensors:
        seen.setdefault(name, t)
    h = hashlib.sha256()
    for name in sorted(seen):
        t = seen[name].detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()
