"""torch's on-disk formats, written and read without importing torch.

Used by the converter (`dcp_stream`, `torch_dist`, `hf_io`), so that `miles convert` never imports
torch: at the sizes people convert on one machine, `import torch` (1.5-2 s) costs more than moving the
bytes. Not meant to be run on its own; tests/ckpt/test_torch_format.py checks every byte against torch.

- `DTYPES`: the dtypes a checkpoint may hold (name, element size, safetensors code, torch's storage
  class name).
- `TorchName`, `Size`, `STRIDED`: stand-ins that pickle under torch's global names (`torch.float32`,
  `torch.Size`, `torch.serialization._get_layout`), as DCP's `.metadata` pickle names them, and
  `Pickler` / `Unpickler` that write and read them.
- `tensor_record(dtype, shape)` -> (head, tail): a `torch.save` archive of one contiguous tensor is
  `head + <the raw little-endian bytes> + tail`, byte for byte what `torch.save` writes with its
  CRC-32 off (`torch.utils.serialization.config.save.compute_crc32 = False`, as the converter always
  saved). The bytes in the middle can therefore be moved by the kernel (`os.copy_file_range`) from
  wherever they are; nothing reads them into this process.
- `object_record(obj)`: `torch.save` of a small tensor-free object (`[None]`, `{}`), with CRC-32, as
  megatron-core writes `_extra_state` and `common.pt`.
- `read_tensor_record(f, offset, length)`: where a `torch.save`d tensor's bytes lie inside a file and
  its dtype, shape and strides, from the zip directory and the pickled header (a restricted unpickler:
  no other globals are resolved).

What it is not: a general zip or pickle library. Archives are the ones torch 2.13's
`PyTorchStreamWriter` writes (stored, 64-byte aligned, zip64 end records, data descriptors); a tensor
record of 4 GiB or more needs zip64 sizes, and `tensor_record` refuses it (`NeedsTorch`, also for
float8 and empty tensors); the caller then uses torch itself for that one tensor.
"""

from __future__ import annotations

import functools
import io
import json
import os
import pickle
import struct
import zlib
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, BinaryIO


@dataclass(frozen=True)
class DType:
    name: str  # torch's attribute name: torch.<name>
    itemsize: int
    safetensors: str  # the safetensors header's dtype code
    storage: str | None  # torch's legacy storage class pickled in torch.save (None: not written here)


DTYPES: dict[str, DType] = {d.name: d for d in (
    DType("float32", 4, "F32", "FloatStorage"), DType("float16", 2, "F16", "HalfStorage"),
    DType("bfloat16", 2, "BF16", "BFloat16Storage"), DType("float64", 8, "F64", "DoubleStorage"),
    DType("int64", 8, "I64", "LongStorage"), DType("int32", 4, "I32", "IntStorage"),
    DType("int16", 2, "I16", "ShortStorage"), DType("int8", 1, "I8", "CharStorage"),
    DType("uint8", 1, "U8", "ByteStorage"), DType("bool", 1, "BOOL", "BoolStorage"),
    # torch.save pickles float8 storages differently (no legacy class): records of these go through torch.
    DType("float8_e4m3fn", 1, "F8_E4M3", None), DType("float8_e5m2", 1, "F8_E5M2", None),
)}
BY_SAFETENSORS = {d.safetensors: d for d in DTYPES.values()}
_BY_STORAGE = {d.storage: d for d in DTYPES.values() if d.storage}


def dtype_of(value: Any) -> DType:
    """A `DType` from a name ("float32"), a `torch.dtype` (str() "torch.float32") or a `TorchName`."""
    name = value.name if isinstance(value, TorchName) else str(value).removeprefix("torch.")
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"dtype {value} is not supported by miles convert (supported: {', '.join(DTYPES)})") from None


def numel(shape: tuple[int, ...] | list[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


# ---------------------------------------------------------------------------------------------------
# Stand-ins for torch objects in pickles


class TorchName:
    """An object pickled as the global `module.name` (a torch dtype, function or class)."""

    def __init__(self, module: str, name: str):
        self.module, self.name = module, name

    def __repr__(self) -> str:
        return f"{self.module}.{self.name}"

    def __eq__(self, other: object) -> bool:
        if isinstance(other, TorchName):
            return (self.module, self.name) == (other.module, other.name)
        return str(other) == repr(self)  # a real torch.dtype prints as torch.float32

    def __hash__(self) -> int:
        return hash((self.module, self.name))

    def __call__(self, *args: Any) -> Any:  # pickle's save_reduce insists on a callable
        raise TypeError(f"{self!r} is a stand-in for a torch global; import torch to call it")


_NAMES: dict[tuple[str, str], TorchName] = {}


def torch_name(module: str, name: str) -> TorchName:
    """The one `TorchName` per global (pickle memoizes by identity, as torch's own singletons)."""
    return _NAMES.setdefault((module, name), TorchName(module, name))


def torch_dtype(name: str) -> TorchName:
    return torch_name("torch", dtype_of(name).name)


# pickle memoizes a global's module string by identity: torch.Size's __module__ is another "torch"
# object than the sys.modules key a dtype's module is found under, so torch's pickles spell "torch" out
# again at the first Size. A distinct string object here does the same (the test compares bytes).
_SIZE = TorchName("".join(("tor", "ch")), "Size")
_GET_LAYOUT = torch_name("torch.serialization", "_get_layout")
_REBUILD = torch_name("torch._utils", "_rebuild_tensor_v2")


class Size(tuple):
    """`torch.Size` in a pickle: `torch.Size((...))`."""

    def __reduce__(self):
        return (_SIZE, (tuple(self),))


class _Layout:
    """`torch.strided` in a pickle: `torch.serialization._get_layout('torch.strided')`."""

    def __init__(self, name: str = "torch.strided"):
        self.name = name

    def __reduce__(self):
        return (_GET_LAYOUT, (self.name,))


STRIDED = _Layout()


class Pickler(pickle._Pickler):  # the Python pickler: `save` can be extended per object
    """Writes `TorchName`s as globals and `globals_map[cls]` = (module, name) for stand-in classes."""

    def __init__(self, file, protocol: int, globals_map: dict[type, tuple[str, str]] | None = None):
        super().__init__(file, protocol=protocol)
        self._globals = globals_map or {}

    def save(self, obj, save_persistent_id=True):
        if isinstance(obj, TorchName):
            return self._global(obj, obj.module, obj.name)
        return super().save(obj, save_persistent_id)

    def save_global(self, obj, name=None):
        ref = self._globals.get(obj) if isinstance(obj, type) else None
        if ref is None:
            return super().save_global(obj, name)
        self._global(obj, *ref)

    def _global(self, obj, module: str, name: str) -> None:
        memo = self.memo.get(id(obj))
        if memo is not None:
            self.write(self.get(memo[0]))
            return
        if self.proto >= 4:
            self.save(module)
            self.save(name)
            self.write(pickle.STACK_GLOBAL)
        else:
            self.write(pickle.GLOBAL + module.encode() + b"\n" + name.encode() + b"\n")
        self.memoize(obj)


class Unpickler(pickle.Unpickler):
    """Reads torch globals back as stand-ins; `by_name` maps (module, name) to stand-in classes.

    Other names: `collections.OrderedDict` and `pathlib` paths; anything else falls back to normal
    resolution (which may import torch) only when `allow_other` is set.
    """

    def __init__(self, file, by_name: dict[tuple[str, str], Any] | None = None, allow_other: bool = True):
        super().__init__(file)
        self._by_name, self._allow_other = by_name or {}, allow_other

    def find_class(self, module: str, name: str):
        if (module, name) in self._by_name:
            return self._by_name[(module, name)]
        if module == "torch":
            if name == "Size":
                return Size
            if name in DTYPES:
                return torch_name(module, name)
            if name in _BY_STORAGE:
                return torch_name(module, name)
        if (module, name) == ("torch.serialization", "_get_layout"):
            return _Layout
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _TensorHeader.rebuild
        if (module, name) == ("collections", "OrderedDict"):
            return OrderedDict
        if module == "pathlib" and name in ("Path", "PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"):
            return super().find_class(module, name)
        if not self._allow_other:
            raise pickle.UnpicklingError(f"unexpected global {module}.{name} in a torch record")
        return super().find_class(module, name)


# ---------------------------------------------------------------------------------------------------
# torch.save archives (PyTorchStreamWriter: miniz, stored entries, 64-byte aligned data)

_ALIGN = 64
_LOCAL = struct.Struct("<IHHHHHIIIHH")  # local file header, 30 bytes
_CENTRAL = struct.Struct("<IHHHHHHIIIHHHHHII")  # central directory header, 46 bytes
_DESCRIPTOR = struct.Struct("<IIII")  # data descriptor with 32-bit sizes
_ZIP64_END = struct.Struct("<IQHHIIQQQQ")  # zip64 end of central directory record, 56 bytes
_ZIP64_LOCATOR = struct.Struct("<IIQI")
_END = struct.Struct("<IHHHHIIH")
_FLAGS = 0x0808  # bit 3: sizes in a data descriptor; bit 11: UTF-8 names
# torch's serialization id = 20 digits of a hash of the record names (an unordered_set walk, so taken
# from torch's output for each record set; a test checks them) + 20 digits of c10::hash_combine over
# the entries' CRC-32s.
_NAMES_HASH_TENSOR = 15728199511854643026  # data.pkl .format_version .storage_alignment byteorder data/0 version
_NAMES_HASH_OBJECT = 2908468677762923104  # the same without data/0
_U32 = 0xFFFFFFFF


class NeedsTorch(ValueError):
    """A record `tensor_record` does not write (zip64 sizes, float8, no elements); use torch.save for it."""


def _hash_combine(seed: int, value: int) -> int:
    return (seed ^ (value + 0x9E3779B9 + ((seed << 6) & 0xFFFFFFFFFFFFFFFF) + (seed >> 2))) & 0xFFFFFFFFFFFFFFFF


class _Archive:
    """Builds an archive entry by entry; `hole(n)` leaves room for n bytes written by someone else."""

    def __init__(self, crc: bool, archive: str = "archive"):
        self.archive = archive
        self.parts: list[bytes | int] = []  # bytes, or the size of a hole
        self.pos = 0
        self.central: list[tuple[str, int, int, int]] = []  # name, crc, size, local header offset
        self.crc = crc
        self.crc_hash = 0

    def _emit(self, b: bytes) -> None:
        self.parts.append(b)
        self.pos += len(b)

    def add(self, name: str, data: bytes | int) -> None:
        size = data if isinstance(data, int) else len(data)
        if size >= _U32 or self.pos >= _U32:
            raise NeedsTorch(f"a {size}-byte entry needs zip64 sizes")
        full = f"{self.archive}/{name}".encode()
        start = self.pos + _LOCAL.size + len(full) + 4
        pad = -start % _ALIGN
        extra = b"FB" + struct.pack("<H", pad) + b"Z" * pad
        offset = self.pos
        self._emit(_LOCAL.pack(0x04034B50, 0, _FLAGS, 0, 0, 0, 0, 0, 0, len(full), len(extra)) + full + extra)
        if isinstance(data, int):
            self.parts.append(data)
            self.pos += data
            crc = 0
        else:
            self._emit(data)
            crc = zlib.crc32(data) if self.crc else 0
        self._emit(_DESCRIPTOR.pack(0x08074B50, crc, size, size))
        self.crc_hash = _hash_combine(self.crc_hash, crc)
        self.central.append((full.decode(), crc, size, offset))

    def finish(self, names_hash: int) -> list[bytes | int]:
        self.add(".data/serialization_id", f"{names_hash:020d}{self.crc_hash:020d}".encode())
        cd_start = self.pos
        cd = b"".join(_CENTRAL.pack(0x02014B50, 0, 0, _FLAGS, 0, 0, 0, crc, size, size, len(name.encode()), 0, 0, 0, 0, 0, off)
                      + name.encode() for name, crc, size, off in self.central)
        n = len(self.central)
        end64 = _ZIP64_END.pack(0x06064B50, 44, 0x031E, 45, 0, 0, n, n, len(cd), cd_start)
        locator = _ZIP64_LOCATOR.pack(0x07064B50, 0, cd_start + len(cd), 1)
        self._emit(cd + end64 + locator + _END.pack(0x06054B50, 0, 0, n, n, len(cd), cd_start, 0))
        return self.parts


def _pickle_protocol2(obj: Any, persistent_id=None) -> bytes:
    buf = io.BytesIO()
    p = Pickler(buf, protocol=2)
    if persistent_id is not None:
        p.persistent_id = persistent_id
    p.dump(obj)
    return buf.getvalue()


class _Storage:
    def __init__(self, dtype: DType, count: int):
        self.dtype, self.count = dtype, count


class _Tensor:
    """What torch.save pickles for a contiguous tensor: `_rebuild_tensor_v2(storage, 0, size, stride, ...)`."""

    def __init__(self, dtype: DType, shape: tuple[int, ...]):
        self.storage = _Storage(dtype, numel(shape))
        self.shape = tuple(shape)

    def __reduce_ex__(self, protocol):
        stride, acc = [], 1
        for s in reversed(self.shape):
            stride.append(acc)
            acc *= s
        return (_REBUILD, (self.storage, 0, self.shape, tuple(reversed(stride)), False, OrderedDict()))


def tensor_record(dtype: Any, shape: tuple[int, ...]) -> tuple[bytes, bytes]:
    """(head, tail) of `torch.save(contiguous tensor)` with CRC-32 off; the raw data goes between them."""
    return _tensor_record(dtype_of(dtype).name, tuple(shape))


@functools.lru_cache(maxsize=1024)  # a model has a handful of distinct tensor shapes, repeated per layer
def _tensor_record(dtype: str, shape: tuple[int, ...]) -> tuple[bytes, bytes]:
    dt = DTYPES[dtype]
    if dt.storage is None:
        raise NeedsTorch(f"torch.save pickles {dt.name} storages in a form not written here")
    if numel(shape) == 0:
        raise NeedsTorch("torch.save lays out an empty tensor's record differently")

    def pid(obj):
        if isinstance(obj, _Storage):
            return ("storage", torch_name("torch", obj.dtype.storage), "0", "cpu", obj.count)
        return None

    nbytes = numel(shape) * dt.itemsize
    ar = _Archive(crc=False)
    ar.add("data.pkl", _pickle_protocol2(_Tensor(dt, tuple(shape)), pid))
    ar.add(".format_version", b"1")
    ar.add(".storage_alignment", b"64")
    ar.add("byteorder", b"little")
    ar.add("data/0", nbytes)
    ar.add("version", b"3\n")
    parts = ar.finish(_NAMES_HASH_TENSOR)
    hole = next(i for i, p in enumerate(parts) if isinstance(p, int))
    return b"".join(parts[:hole]), b"".join(parts[hole + 1:])  # type: ignore[arg-type]


def object_record(obj: Any, archive: str = "archive") -> bytes:
    """`torch.save(obj)` (CRC-32 on, torch's default) for a small object holding no tensors.

    `archive` is the entries' folder: "archive" when torch saves to a stream, the file name without
    its extension when it saves to a path (`torch.save({}, "common.pt")` -> "common").
    """
    ar = _Archive(crc=True, archive=archive)
    ar.add("data.pkl", _pickle_protocol2(obj))
    ar.add(".format_version", b"1")
    ar.add(".storage_alignment", b"64")
    ar.add("byteorder", b"little")
    ar.add("version", b"3\n")
    return b"".join(ar.finish(_NAMES_HASH_OBJECT))  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------------
# Reading a torch.save record inside a larger file


@dataclass(frozen=True)
class TensorLocation:
    """A tensor record's bytes: `nbytes` at absolute file `offset`, row-major `shape`."""

    dtype: DType
    shape: tuple[int, ...]
    offset: int
    nbytes: int


class _TensorHeader:
    def __init__(self, storage, storage_offset, size, stride):
        self.storage, self.storage_offset, self.size, self.stride = storage, storage_offset, tuple(size), tuple(stride)

    @classmethod
    def rebuild(cls, storage, storage_offset, size, stride, requires_grad=False, backward_hooks=None, metadata=None):
        return cls(storage, storage_offset, size, stride)


class NotPlain(ValueError):
    """The record is not one contiguous tensor this module can locate (the caller falls back to torch)."""


def read_tensor_record(f: BinaryIO, offset: int, length: int) -> TensorLocation:
    """Locate the tensor of the `torch.save` archive at [offset, offset + length) of file `f`."""
    tail_len = _ZIP64_END.size + _ZIP64_LOCATOR.size + _END.size
    f.seek(offset + length - tail_len)
    tail = f.read(tail_len)
    sig, _, _, _, _, _, n, _, cd_size, cd_start = _ZIP64_END.unpack_from(tail, 0)
    if sig != 0x06064B50:
        end = _END.unpack_from(tail, tail_len - _END.size)
        if end[0] != 0x06054B50:
            raise NotPlain("no zip end record")
        n, cd_size, cd_start = end[4], end[5], end[6]
    f.seek(offset + cd_start)
    cd = f.read(cd_size)
    entries: dict[str, tuple[int, int]] = {}  # name -> (size, local header offset)
    p = 0
    for _ in range(n):
        (sig, _, _, _, method, _, _, _, csize, usize, name_len, extra_len, comment_len, _, _, _, local) = _CENTRAL.unpack_from(cd, p)
        name = cd[p + 46:p + 46 + name_len].decode()
        extra = cd[p + 46 + name_len:p + 46 + name_len + extra_len]
        if method != 0:
            raise NotPlain(f"{name} is compressed")
        usize, local = _zip64_fields(extra, usize, csize, local)
        entries[name] = (usize, local)
        p += 46 + name_len + extra_len + comment_len
    pkl = next((k for k in entries if k.endswith("/data.pkl")), None)
    if pkl is None:
        raise NotPlain("no data.pkl")
    prefix = pkl[: -len("data.pkl")]

    def data_start(name: str) -> int:
        size, local = entries[name]
        f.seek(offset + local)
        h = _LOCAL.unpack(f.read(_LOCAL.size))
        return offset + local + _LOCAL.size + h[9] + h[10]

    f.seek(data_start(pkl))
    storages: dict[str, tuple[DType, int]] = {}

    class _U(Unpickler):
        def persistent_load(self, pid):
            kind, storage_type, key, _location, count = pid
            dt = _BY_STORAGE.get(getattr(storage_type, "name", None))
            if kind != "storage" or dt is None:
                raise NotPlain(f"storage {storage_type}")
            storages[key] = (dt, count)
            return key

    header = _U(io.BytesIO(f.read(entries[pkl][0])), allow_other=False).load()
    if not isinstance(header, _TensorHeader) or header.storage not in storages:
        raise NotPlain("not a single tensor")
    dt, count = storages[header.storage]
    want, acc = [], 1
    for s in reversed(header.size):
        want.append(acc)
        acc *= s
    n_el = numel(header.size)
    if tuple(reversed(want)) != header.stride and n_el > 1:
        raise NotPlain(f"strides {header.stride} are not row-major for {header.size}")
    if header.storage_offset + n_el > count:
        raise NotPlain("tensor extends past its storage")
    name = f"{prefix}data/{header.storage}"
    start = data_start(name) + header.storage_offset * dt.itemsize
    return TensorLocation(dt, header.size, start, n_el * dt.itemsize)


def _zip64_fields(extra: bytes, usize: int, csize: int, local: int) -> tuple[int, int]:
    p = 0
    while p + 4 <= len(extra):
        tag, size = struct.unpack_from("<HH", extra, p)
        if tag == 0x0001:
            q = p + 4
            if usize == _U32:
                usize = struct.unpack_from("<Q", extra, q)[0]
                q += 8
            if csize == _U32:
                q += 8
            if local == _U32:
                local = struct.unpack_from("<Q", extra, q)[0]
        p += 4 + size
    return usize, local


# ---------------------------------------------------------------------------------------------------
# safetensors headers


SAFETENSORS_MAX_HEADER = 100_000_000  # safetensors' MAX_HEADER_SIZE


def safetensors_header(path) -> tuple[dict[str, dict], int]:
    """The header of a safetensors file (name -> {dtype, shape, data_offsets}) and where its data starts."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        head = f.read(8)
        if len(head) != 8:
            raise ValueError(f"{path} is too short to be a safetensors file")
        (n,) = struct.unpack("<Q", head)
        # The bound the safetensors library enforces, and the file's own size: a length read from a
        # file that is not safetensors must not become an allocation of that many bytes.
        if n > min(SAFETENSORS_MAX_HEADER, size - 8):
            raise ValueError(f"its first 8 bytes give a header of {n} bytes, more than the file holds or safetensors allows, so it is not a safetensors file")
        raw = f.read(n)
    if len(raw) != n:
        raise ValueError(f"{path}: the header is cut short")
    header = json.loads(raw)
    if not isinstance(header, dict):
        raise ValueError("its header is not a JSON object, so it is not a safetensors file")
    header.pop("__metadata__", None)
    return header, 8 + n
