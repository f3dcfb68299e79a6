"""Write a torch DCP checkpoint tensor by tensor, and read its `.metadata` index, without importing torch.

Used by `torch_dist.save_torch_dist` (writing) and `torch_dist.TorchDistReader` (reading). Not meant
to be run on its own; `python bench/convert.py` measures it and tests/ckpt/test_convert_streaming.py
checks it against megatron-core's own `dist_checkpointing.save` and `load`.

Why not torch's `torch.distributed.checkpoint.save`: importing torch takes 1.5-2 s here and that
package another 1.5-2.5 s (DTensor, torch.fx, sympy), more than copying a 1 GB checkpoint takes. The
format is small and stable, and this module writes it the way torch's
`FileSystemWriter(single_file_per_rank=True)` does:

- data files `__0_<n>.distcp`: each tensor is one `torch.save` record at the current offset (written
  by torch_format.py: header, the raw bytes, the zip directory), each bytes item its bytes verbatim;
  a new file starts once one holds `file_bytes`;
- `.metadata`: a pickle of torch's `Metadata` (tensor keys, global sizes, chunk offsets and sizes,
  dtypes; where each item's bytes lie), written to `.metadata.tmp`, fsynced, then renamed.

The `.metadata` pickle names torch's classes (`torch.distributed.checkpoint.metadata.Metadata`,
`torch.Size`, `torch.bfloat16`, ...) and carries exactly the state theirs pickle (dataclass fields;
TensorProperties' tuple; `_StorageInfo` without its None fields), so torch's and megatron-core's
readers load it as their own. Here those classes are small look-alikes, written under the torch names
and read back into the look-alikes (`_GLOBALS`, torch_format's `Pickler`/`Unpickler`). Pinned to torch
2.13's DCP format version "1.0.0"; the tests compare with what megatron-core writes through torch.

Memory and speed: `produce(name)` is called when an item's bytes are due. It returns a
`bytecopy.Source` (file ranges: the kernel copies them, nothing passes through this process) or an
in-memory torch tensor (tests; dropped once written). The data must be on disk before `.metadata`
points at it: `bytecopy.OutputFile` overlaps writeback with the copying and fsyncs each file on close.
"""

from __future__ import annotations

import io
import os
import pickle
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from miles.ckpt.convert import bytecopy
from miles.ckpt.convert.torch_format import STRIDED, NeedsTorch, Pickler, Size, Unpickler, dtype_of, numel, tensor_record, torch_dtype

DCP_VERSION = "1.0.0"  # torch 2.13's torch.distributed.checkpoint.CURRENT_DCP_VERSION
METADATA = ".metadata"
_MD = "torch.distributed.checkpoint.metadata"
_FS = "torch.distributed.checkpoint.filesystem"


# Look-alikes of torch's DCP metadata classes: same field names, same pickled state.
@dataclass
class ChunkStorageMetadata:
    offsets: Size
    sizes: Size


class _MemFormat:
    """torch's `_MEM_FORMAT_ENCODING` enum member (pickled as a call with its value)."""

    def __init__(self, value: int):
        self.value = value

    def __reduce__(self):
        return (_MemFormat, (self.value,))


@dataclass
class TensorProperties:
    dtype: Any  # torch_format.TorchName of the dtype (prints as torch.float32)

    def __getstate__(self):
        # (dtype, layout, requires_grad, memory-format encoding, pin_memory), as torch pickles it.
        return (self.dtype, STRIDED, False, _MemFormat(0), False)

    def __setstate__(self, state):
        self.dtype = state[0]


@dataclass
class TensorStorageMetadata:
    properties: TensorProperties
    size: Size
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

    def __init__(self, fqn: str, offset: tuple[int, ...] | None = None, index: int | None = None):
        self.fqn, self.index = fqn, index
        if offset is not None:  # torch's leaves the field at its class default None
            self.offset = Size(offset)

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


def read_metadata(ckpt_dir: Path) -> Metadata:
    """The `.metadata` index of a DCP checkpoint (whoever wrote it), as the look-alike classes."""
    with open(ckpt_dir / METADATA, "rb") as f:
        return Unpickler(f, by_name=_BY_NAME).load()


@dataclass(frozen=True)
class Item:
    """One thing to write: a tensor chunk (`offsets` set) or a bytes object (`data` set)."""

    fqn: str
    offsets: tuple[int, ...] | None = None  # the chunk's offsets in the global tensor (None: bytes item)
    global_size: tuple[int, ...] | None = None
    name: str = ""  # what `produce` is asked for
    shape: tuple[int, ...] = ()  # the produced tensor's shape and dtype, checked before writing
    dtype: Any = None  # a dtype name ("float32"), or a torch.dtype
    data: bytes = b""


def save(items: list[Item], produce: Callable[[str], Any], ckpt_dir: Path, file_bytes: int) -> None:
    """Write `items` in order into `ckpt_dir` (existing), then `.metadata`; one tensor in memory at a time."""
    state_dict_metadata: dict[str, Any] = {}
    storage_data: dict[MetadataIndex, _StorageInfo] = {}
    n_files, f, file = 0, None, ""
    try:
        for it in items:
            if f is None or f.pos >= file_bytes:
                if f is not None:
                    f.close()
                file = f"__0_{n_files}.distcp"
                n_files += 1
                f = bytecopy.OutputFile(ckpt_dir / file)
            start = f.pos
            if it.offsets is None:
                state_dict_metadata[it.fqn] = BytesStorageMetadata()
                index = MetadataIndex(it.fqn)
                f.write(it.data)
            else:
                dtype = dtype_of(it.dtype).name
                chunk_sizes = Size([1] * (len(it.offsets) - len(it.shape)) + list(it.shape))
                md = state_dict_metadata.setdefault(
                    it.fqn, TensorStorageMetadata(TensorProperties(torch_dtype(dtype)), Size(it.global_size), []))
                md.chunks.append(ChunkStorageMetadata(Size(it.offsets), chunk_sizes))
                index = MetadataIndex(it.fqn, it.offsets, len(md.chunks) - 1)
                data = produce(it.name)
                got = (tuple(data.shape), dtype_of(data.dtype).name)
                if got != (tuple(it.shape), dtype):
                    raise RuntimeError(f"{it.name}: produced {got[0]} {got[1]}, planned {tuple(it.shape)} {dtype}")
                _write_record(f, data, chunk_sizes)
                del data  # the only reference: freed before the next one is made
            storage_data[index] = _StorageInfo(file, start, f.pos - start)
    finally:
        if f is not None:
            f.close()
    meta = Metadata(state_dict_metadata, storage_data=storage_data, version=DCP_VERSION,
                    storage_meta=StorageMeta(checkpoint_id=ckpt_dir, save_id=str(uuid.uuid4())))
    buf = io.BytesIO()
    Pickler(buf, protocol=pickle.DEFAULT_PROTOCOL, globals_map=_GLOBALS).dump(meta)
    tmp = ckpt_dir / (METADATA + ".tmp")
    bytecopy.write_durably(tmp, buf.getvalue())
    os.replace(tmp, ckpt_dir / METADATA)


def _write_record(f: bytecopy.OutputFile, data: Any, chunk_sizes: Size) -> None:
    """One `torch.save` record of `data` (a Source or a torch tensor) with the chunk's shape."""
    try:
        head, tail = tensor_record(dtype_of(data.dtype).name, tuple(chunk_sizes))
    except NeedsTorch:
        f.write(_torch_save_bytes(data, chunk_sizes))
        return
    f.write(head)
    if isinstance(data, bytecopy.Source):
        for seg in data.segments:
            f.copy(seg)
    else:
        f.write(_tensor_bytes(data))
    f.write(tail)


def _tensor_bytes(tensor: Any) -> memoryview:
    import torch  # a tensor exists, so torch is already imported

    return memoryview(tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy())


def _torch_save_bytes(data: Any, chunk_sizes: Size) -> bytes:
    """torch.save of one record the stand-in writer does not produce (4 GiB or more, float8, empty)."""
    import torch
    from torch.utils.serialization import config

    if isinstance(data, bytecopy.Source):
        tensor = torch.empty(numel(data.shape), dtype=getattr(torch, dtype_of(data.dtype).name))
        raw = tensor.view(torch.uint8).numpy()
        at = 0
        for seg in data.segments:
            at += os.preadv(bytecopy.SOURCES.fd(seg.path), [memoryview(raw)[at:at + seg.nbytes]], seg.offset)
        data = tensor
    tensor = data.detach().contiguous().reshape(tuple(chunk_sizes))
    if tensor.untyped_storage().nbytes() != tensor.nbytes:
        tensor = tensor.clone()  # torch.save writes the whole storage, not just the view
    buf = io.BytesIO()
    with config.patch({"save.compute_crc32": False}):  # as the stand-in records: no reader checks it
        torch.save(tensor, buf)
    return buf.getvalue()
