"""Stream tensors into a torch DCP checkpoint: made one at a time, written in order, dropped once written.

Two small subclasses of torch.distributed.checkpoint's public extension points, used by
`torch_dist.save_torch_dist` through `torch.distributed.checkpoint.save(..., no_dist=True)`:

- `LazyPlanner`: a `DefaultSavePlanner` over precomputed `WriteItem`s (key, chunk offsets and sizes,
  dtype) instead of a state dict of tensors; each tensor is made by `produce(name)` only when the
  storage writer asks for it (`resolve_data`). Global planning (the `.metadata` index, chunk
  validation) stays torch's own.
- `StreamingWriter`: a `FileSystemWriter` whose `write_data` writes items in plan order and lets each
  tensor go as soon as its bytes are written. torch's own `write_data` collects a file's tensors in a
  dict until the file is closed (and sorts them by size with several threads), which holds the whole
  model for a one-file checkpoint. Items are written exactly as torch writes them (`torch.save` of the
  tensor at the current offset, bytes items verbatim), and `finish` (the `.metadata` file, written via
  a temporary name) is torch's.

The one private name used is `torch.distributed.checkpoint.filesystem._StorageInfo`, the per-item
record in the `.metadata` index that `FileSystemReader` reads back (pinned: torch 2.13).
Importing this module imports torch; `torch_dist` imports it only when saving.
"""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import torch
from torch.futures import Future
from torch.distributed.checkpoint import DefaultSavePlanner, FileSystemWriter
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

if TYPE_CHECKING:
    from miles.ckpt.convert.torch_dist import PlannedTensor


class LazyPlanner(DefaultSavePlanner):
    """Plans precomputed write items; `resolve_data` makes each tensor on demand and checks it."""

    def __init__(self, items: list[WriteItem], planned: dict[MetadataIndex, PlannedTensor],
                 produce: Callable[[str], torch.Tensor]):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        # MetadataIndex equality ignores the index hint that global planning rewrites.
        self._items, self._planned, self._produce = items, planned, produce

    def create_local_plan(self) -> SavePlan:
        self.plan = SavePlan(items=list(self._items))
        return self.plan

    def resolve_data(self, write_item: WriteItem) -> Any:
        if write_item.type == WriteItemType.BYTE_IO:
            buf = io.BytesIO()
            torch.save([None], buf)  # megatron-core stores a ShardedObject as torch.save([data])
            return buf
        p = self._planned[write_item.index]
        tensor = self._produce(p.name)
        if tuple(tensor.shape) != p.shape or tensor.dtype != p.dtype:
            raise RuntimeError(f"{p.name}: produced {tuple(tensor.shape)} {tensor.dtype}, planned {p.shape} {p.dtype}")
        tensor = tensor.detach().contiguous().reshape(write_item.tensor_data.chunk.sizes)
        if tensor.untyped_storage().nbytes() != tensor.nbytes:
            tensor = tensor.clone()  # torch.save writes the whole storage, not just the view
        return tensor


class StreamingWriter(FileSystemWriter):
    """FileSystemWriter writing in plan order, one tensor in memory, a new file every `file_bytes`."""

    def __init__(self, path: Path, file_bytes: int):
        super().__init__(str(path), single_file_per_rank=True, sync_files=True, thread_count=1, overwrite=True)
        self.file_bytes = file_bytes

    def write_data(self, plan: SavePlan, planner: LazyPlanner) -> Future:
        results: list[WriteResult] = []
        prefix, n_files, f, name = plan.storage_data.prefix, 0, None, ""
        try:
            for item in plan.items:
                if f is None or f.tell() >= self.file_bytes:
                    if f is not None:
                        _close_synced(f)
                    name = f"{prefix}{n_files}.distcp"
                    n_files += 1
                    f = open(os.path.join(self.path, name), "wb")
                data = planner.resolve_data(item)
                start = f.tell()
                if item.type == WriteItemType.BYTE_IO:
                    f.write(data.getbuffer())
                else:
                    torch.save(data, f)
                del data  # the only reference: the tensor is freed before the next one is made
                length = f.tell() - start
                results.append(WriteResult(index=item.index, size_in_bytes=length,
                                           storage_data=_StorageInfo(name, start, length)))
        finally:
            if f is not None:
                _close_synced(f)
        done: Future = Future()
        done.set_result(results)
        return done


def _close_synced(f: io.BufferedWriter) -> None:
    # The .metadata index is written after this; the data it points at must be on disk first.
    f.flush()
    os.fsync(f.fileno())
    f.close()
