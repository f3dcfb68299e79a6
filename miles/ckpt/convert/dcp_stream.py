"""Write a torch DCP checkpoint tensor by tensor, and read its `.metadata` index, without importing
`torch.distributed.checkpoint`.

Used by `torch_dist.save_torch_dist` (writing) and `torch_dist.TorchDistReader` (reading). Not meant
to be run on its own; `python bench/convert.py` measures it and tests/ckpt/test_convert_streaming.py
checks it against megatron-core's own `dist_checkpointing.save` and `load`.

Why not torch's `torch.distributed.checkpoint.save`: importing that package pulls in DTensor, torch.fx
and sympy, about 1.5-2.5 s here, more than copying a 1 GB checkpoint takes, so at the sizes people
convert on one machine it was a third of the conversion. The format is small and stable, and this
module writes it the way torch's `FileSystemWriter(single_file_per_rank=True)` does:

- data files `__0_<n>.distcp`: each tensor is one `torch.save` record at the current offset, each
  bytes item its bytes verbatim; a new file starts once one holds `file_bytes`;
- `.metadata`: a pickle of torch's `Metadata` (tensor keys, global sizes, chunk offsets and sizes,
  dtypes; where each item's bytes lie), written to `.metadata.tmp`, fsynced, then renamed.

The `.metadata` pickle names torch's classes (`torch.distributed.checkpoint.metadata.Metadata`, ...)
and carries exactly the state theirs pickle (dataclass fields; TensorProperties' tuple; `_StorageInfo`
without its None fields), so torch's and megatron-core's readers load it as their own. Here those
classes are small look-alikes (`_GLOBALS`), written under the torch names by `_Pickler` and read back
into the look-alikes by `_Unpickler` (other names resolve normally). Pinned to torch 2.13's DCP
format version "1.0.0"; the tests compare with what megatron-core writes through torch itself.

Memory: one tensor at a time (`produce(name)` is called when its bytes are due and the tensor is
dropped once written). Speed: `torch.save` would compute a CRC-32 of every record for the zip
directory, about half its time; nothing reads it (`torch.load`, DCP's and megatron-core's readers
never check it), so it is off for these records only (restored after the save). The data must be on
disk before `.metadata` points at it, but one fsync at the end waits for the whole file's writeback;
a background thread runs `fdatasync` after every `SYNC_BYTES` written instead, so writeback overlaps
the conversion and the closing fsync waits only for the tail.
"""

from __future__ import annotations

import io
import os
import pickle
import threading
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

DCP_VERSION = "1.0.0"  # torch 2.13's torch.distributed.checkpoint.CURRENT_DCP_VERSION
METADATA = ".metadata"
_MD = "torch.distributed.checkpoint.metadata"
_FS = "torch.distributed.checkpoint.filesystem"
# Bytes written between background fdatasync calls: rare enough to cost nothing, frequent enough that
# the closing fsync has little left to wait for.
SYNC_BYTES = 256 * 1024**2


# Look-alikes of torch's DCP metadata classes: same field names, same pickled state.
@dataclass
class ChunkStorageMetadata:
    offsets: torch.Size
    sizes: torch.Size


class _MemFormat:
    """torch's `_MEM_FORMAT_ENCODING` enum member (pickled as a call with its value)."""

    def __init__(self, value: int):
        self.value = value

    def __reduce__(self):
        return (_MemFormat, (self.value,))


@dataclass
class TensorProperties:
    dtype: torch.dtype

    def __getstate__(self):
        # (dtype, layout, requires_grad, memory-format encoding, pin_memory), as torch pickles it.
        return (self.dtype, torch.strided, False, _MemFormat(0), False)

    def __setstate__(self, state):
        self.dtype = state[0]


@dataclass
class TensorStorageMetadata:
    properties: TensorProperties
    size: torch.Size
    chunks: list[ChunkStorageMetadata]


@dataclass
class BytesStorageMetadata:
    pass


@dataclass
class StorageMeta:
    checkpoint_id: Any = None
    save_id: str | None = None
    load_id: str | None = None
    modules: list[str] = field(default_factory=list)


@dataclass
class Metadata:
    state_dict_metadata: dict[str, Any]
    planner_data: Any = None
    storage_data: Any = None
    storage_meta: StorageMeta | None = None
    version: str | None = None


class MetadataIndex:
    """Key of `storage_data`: (fqn, chunk offset); `index` is a lookup hint, not part of equality."""

    def __init__(self, fqn: str, offset: torch.Size | None = None, index: int | None = None):
        self.fqn, self.index = fqn, index
        if offset is not None:  # torch's leaves the field at its class default None
            self.offset = torch.Size(offset)

    def _key(self) -> tuple:
        return (self.fqn, getattr(self, "offset", None))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, MetadataIndex) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())


@dataclass
class _StorageInfo:
    relative_path: str
    offset: int
    length: int
    transform_descriptors: Any = None

    def __getstate__(self):
        return {k: v for k, v in self.__dict__.items() if v is not None}


_GLOBALS: dict[type, tuple[str, str]] = {
    ChunkStorageMetadata: (_MD, "ChunkStorageMetadata"), _MemFormat: (_MD, "_MEM_FORMAT_ENCODING"),
    TensorProperties: (_MD, "TensorProperties"), TensorStorageMetadata: (_MD, "TensorStorageMetadata"),
    BytesStorageMetadata: (_MD, "BytesStorageMetadata"), StorageMeta: (_MD, "StorageMeta"),
    Metadata: (_MD, "Metadata"), MetadataIndex: (_MD, "MetadataIndex"), _StorageInfo: (_FS, "_StorageInfo"),
}
_BY_NAME = {name: cls for cls, name in _GLOBALS.items()}


class _Pickler(pickle._Pickler):  # the Python pickler: its save_global can be overridden per class
    def save_global(self, obj, name=None):
        ref = _GLOBALS.get(obj) if isinstance(obj, type) else None
        if ref is None:
            return super().save_global(obj, name)
        self.save(ref[0])
        self.save(ref[1])
        self.write(pickle.STACK_GLOBAL)
        self.memoize(obj)


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        return _BY_NAME.get((module, name)) or super().find_class(module, name)


def read_metadata(ckpt_dir: Path) -> Metadata:
    """The `.metadata` index of a DCP checkpoint (whoever wrote it), as the look-alike classes."""
    with open(ckpt_dir / METADATA, "rb") as f:
        return _Unpickler(f).load()


@dataclass(frozen=True)
class Item:
    """One thing to write: a tensor chunk (`planned` set) or a bytes object (`data` set)."""

    fqn: str
    offsets: torch.Size | None = None  # the chunk's offsets in the global tensor (None: bytes item)
    global_size: torch.Size | None = None
    name: str = ""  # what `produce` is asked for
    shape: tuple[int, ...] = ()  # the produced tensor's shape and dtype, checked before writing
    dtype: torch.dtype | None = None
    data: bytes = b""


def save(items: list[Item], produce: Callable[[str], torch.Tensor], ckpt_dir: Path, file_bytes: int) -> None:
    """Write `items` in order into `ckpt_dir` (existing), then `.metadata`; one tensor in memory at a time."""
    from torch.utils.serialization import config

    state_dict_metadata: dict[str, Any] = {}
    storage_data: dict[MetadataIndex, _StorageInfo] = {}
    n_files, f, file = 0, None, ""
    try:
        with config.patch({"save.compute_crc32": False}):
            for it in items:
                if f is None or f.tell() >= file_bytes:
                    if f is not None:
                        f.close()
                    file = f"__0_{n_files}.distcp"
                    n_files += 1
                    f = _SyncingFile(ckpt_dir / file)
                start = f.tell()
                if it.offsets is None:
                    state_dict_metadata[it.fqn] = BytesStorageMetadata()
                    index = MetadataIndex(it.fqn)
                    f.write(it.data)
                else:
                    tensor = produce(it.name)
                    if tuple(tensor.shape) != it.shape or tensor.dtype != it.dtype:
                        raise RuntimeError(f"{it.name}: produced {tuple(tensor.shape)} {tensor.dtype}, planned {it.shape} {it.dtype}")
                    chunk_sizes = torch.Size([1] * (len(it.offsets) - len(it.shape)) + list(it.shape))
                    tensor = tensor.detach().contiguous().reshape(chunk_sizes)
                    if tensor.untyped_storage().nbytes() != tensor.nbytes:
                        tensor = tensor.clone()  # torch.save writes the whole storage, not just the view
                    md = state_dict_metadata.setdefault(
                        it.fqn, TensorStorageMetadata(TensorProperties(it.dtype), it.global_size, []))
                    md.chunks.append(ChunkStorageMetadata(it.offsets, chunk_sizes))
                    index = MetadataIndex(it.fqn, it.offsets, len(md.chunks) - 1)
                    torch.save(tensor, f)
                    del tensor  # the only reference: freed before the next one is made
                f.wrote()
                storage_data[index] = _StorageInfo(file, start, f.tell() - start)
    finally:
        if f is not None:
            f.close()
    meta = Metadata(state_dict_metadata, storage_data=storage_data, version=DCP_VERSION,
                    storage_meta=StorageMeta(checkpoint_id=ckpt_dir, save_id=str(uuid.uuid4())))
    tmp = ckpt_dir / (METADATA + ".tmp")
    with open(tmp, "wb") as out:
        _Pickler(out, protocol=pickle.DEFAULT_PROTOCOL).dump(meta)
        out.flush()
        os.fsync(out.fileno())
    os.replace(tmp, ckpt_dir / METADATA)


class _SyncingFile(io.BufferedWriter):
    """A file whose writeback runs in a background thread while writing goes on; `close` fsyncs it.

    `wrote()` (called between records) starts an `fdatasync` once `SYNC_BYTES` more have been written
    and the previous one has finished; the thread only waits in the kernel.
    """

    def __init__(self, path: Path):
        super().__init__(io.FileIO(path, "wb"), buffer_size=1024**2)
        self._synced_to = 0
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def wrote(self) -> None:
        if self.tell() - self._synced_to < SYNC_BYTES or (self._thread is not None and self._thread.is_alive()):
            return
        self.flush()
        self._synced_to = self.tell()
        self._thread = threading.Thread(target=self._sync, name="convert-writeback", daemon=True)
        self._thread.start()

    def _sync(self) -> None:
        try:
            os.fdatasync(self.fileno())
        except BaseException as e:  # re-raised on the writing thread by close()
            self._error = e

    def close(self) -> None:
        if self.closed:
            return
        try:
            # `.metadata` is written after this; the data it points at must be on disk first.
            self.flush()
            if self._thread is not None:
                self._thread.join()
            if self._error is not None:
                raise self._error
            os.fsync(self.fileno())
        finally:
            super().close()
