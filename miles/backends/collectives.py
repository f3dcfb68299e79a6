"""Collectives on tensors of the device their process group talks through.

NCCL only moves CUDA tensors and gloo only CPU ones (NCCL raises "No backend type associated with
device type cpu"), so a reduction tensor the trainer builds itself (metrics, a broadcast's receive
buffer, a weight gather's placeholder) must be made on the group's device, not on the CPU by habit.
`group_device(group)` says which: cuda (the current device) for an NCCL group, the CPU for gloo and
for a mixed `cpu:gloo,cuda:nccl` group (whose CPU half takes CPU tensors).

Use: `reduce_floats([1.0, 2.0], op=dist.ReduceOp.SUM, group=g)` -> the group's sums, as floats;
`on_group_device(t, group)` before a collective on a tensor that may live elsewhere.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def backend_device(backend: str) -> torch.device:
    """The device whose tensors a process group of `backend` moves: "nccl" -> cuda, anything with a
    CPU backend in it ("gloo", "cpu:gloo,cuda:nccl", "mpi") -> cpu."""
    name = str(backend).lower()
    per_device = dict(part.split(":", 1) for part in name.split(",") if ":" in part)
    if per_device:  # a "cpu:gloo,cuda:nccl" group: CPU tensors go through its CPU backend
        return torch.device("cpu") if "cpu" in per_device else _cuda()
    return _cuda() if name == "nccl" else torch.device("cpu")


def _cuda() -> torch.device:
    # The index, not bare "cuda": a rank that set its device (torch.cuda.set_device) reduces there.
    return torch.device("cuda", torch.cuda.current_device())


def group_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """The device of `group`'s collectives (None: the default group)."""
    return backend_device(dist.get_backend(group))


def on_group_device(t: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """`t` on `group`'s device (itself when it is already there)."""
    device = group_device(group)
    return t if t.device == device else t.to(device)


def reduce_floats(values: list[float], *, op=dist.ReduceOp.SUM, group: dist.ProcessGroup | None = None) -> list[float]:
    """All-reduce `values` (float64, so sums of counts stay exact) over `group`, on its device."""
    packed = torch.tensor(values, dtype=torch.float64, device=group_device(group))
    dist.all_reduce(packed, op=op, group=group)
    return packed.tolist()


def all_reduce_(t: torch.Tensor, *, op=dist.ReduceOp.SUM, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """In-place all-reduce of `t` over `group`; a tensor on another device than the group's travels
    there and back (a CPU statistic under NCCL)."""
    moved = on_group_device(t, group)
    dist.all_reduce(moved, op=op, group=group)
    if moved is not t:
        t.copy_(moved)
    return t


def broadcast_(t: torch.Tensor, *, src: int, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """In-place broadcast of `t` from global rank `src` over `group`, through the group's device."""
    moved = on_group_device(t, group)
    dist.broadcast(moved, src=src, group=group)
    if moved is not t:
        t.copy_(moved)
    return t


def select_cuda_device(rank: int) -> None:
    """Pin this process to its GPU before its first NCCL collective: under Ray each worker sees one GPU
    (index 0); processes started together on one node that all see every GPU take `rank % count`."""
    count = torch.cuda.device_count()
    if count > 1:
        torch.cuda.set_device(rank % count)
