"""Free a trainer's device memory while the engines generate, and give it back bit for bit.

`HostStash.offload(tensors, device)` copies the storage of every tensor on `device` into host memory
(pinned when the device is a GPU) and then shrinks that storage to zero bytes; `restore()` grows each
storage back and copies the bytes in. The tensors themselves (and every view of their storage) stay
the same Python objects, so whatever holds them still holds them afterwards: megatron-core's DDP,
whose parameters and `main_grad`s are views into flat buffers, its distributed optimizer, whose fp32
shards are views of those, and the optimizer's moments. A storage shared by several tensors (tied
weights, views of one buffer) is copied once. Storages of `discard` tensors are freed without a copy
and come back zeroed (gradient buffers, which the next step zeroes anyway).

Moving each tensor with `.to("cpu")` instead would replace `param.data` and break those views (after
the move back a parameter would no longer be the buffer the optimizer writes into).

Use: `stash = HostStash(); freed = stash.offload(tensors, torch.device("cuda"), discard=grads)`; later
`stash.restore()`.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


class HostStash:
    """Device storages released to host memory; see the module docstring."""

    def __init__(self) -> None:
        self._held: list[tuple[torch.UntypedStorage, torch.Tensor | None, int]] = []

    @property
    def offloaded(self) -> bool:
        return bool(self._held)

    def offload(self, tensors: Iterable[torch.Tensor], device: torch.device | str,
                *, discard: Iterable[torch.Tensor] = ()) -> int:
        """Release the storage on `device` of every tensor (copied to host) and of every `discard` tensor
        (dropped); returns the bytes released."""
        if self._held:
            raise RuntimeError("offload called twice without restore")
        device = torch.device(device)

        def storages(group: Iterable[torch.Tensor]) -> dict[int, torch.UntypedStorage]:
            out = {}
            for t in group:
                s = t.untyped_storage()
                if s.device.type == device.type and s.nbytes() > 0:
                    out.setdefault(s.data_ptr(), s)
            return out

        kept = storages(tensors)
        dropped = {k: s for k, s in storages(discard).items() if k not in kept}  # in both lists: kept
        plan = [(s, True) for s in kept.values()] + [(s, False) for s in dropped.values()]
        if plan and device.type == "cuda":
            torch.cuda.synchronize()  # pending kernels may still write these storages
        freed = 0
        for s, keep in plan:
            n = s.nbytes()
            host = None
            if keep:
                host = torch.empty(n, dtype=torch.uint8, pin_memory=device.type == "cuda")
                host.untyped_storage().copy_(s)
            s.resize_(0)
            self._held.append((s, host, n))
            freed += n
        if plan and device.type == "cuda":
            torch.cuda.empty_cache()  # give the freed blocks back to the driver, for the engine
        return freed

    def restore(self) -> None:
        """Every released storage back at its size, with its bytes (zeros for discarded ones)."""
        for s, host, n in self._held:
            s.resize_(n)
            if host is None:
                s.fill_(0)
            else:
                s.copy_(host.untyped_storage())
        self._held = []
