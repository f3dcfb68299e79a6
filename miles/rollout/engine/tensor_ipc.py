"""Tensors by handle between processes of one host: the payload of SGLang's `/update_weights_from_tensor`.

SGLang's colocated weight path sends no tensor bytes over HTTP. The body carries, per engine TP rank,
a base64 string of a `ForkingPickler` pickle in which every tensor is a *handle*: a CUDA IPC handle
of the trainer's GPU memory, or on a CPU the name of a shared-memory segment. The engine maps the
handle, copies into its model and lets go; the sender keeps the memory alive until the call returns.

Producer, `serialize_bucket(views)` after `flatten_bucket(bucket)`: a bucket is copied once into a
fresh flat buffer (a shared-memory segment on a CPU, the caching allocator on a GPU) and sent as
`[(name, view into the buffer), ...]`, so one bucket is one handle and the live weights are never
exported (SGLang's `load_format=None` body; its `flattened_bucket` needs SGLang's own classes).

- CUDA: the device index in the pickle becomes the GPU's UUID, as SGLang's
  `monkey_patch_torch_reductions` does: the engine sees the GPU under another index (its own
  CUDA_VISIBLE_DEVICES); SGLang's engine maps the UUID back, and so does `TensorPayloadUnpickler`.
- CPU: storages travel by file name (torch's `file_system` sharing strategy, chosen for this
  pickler only; the process-wide strategy is left alone). torch's default `file_descriptor`
  strategy hands an fd through multiprocessing's resource sharer, which only a child process that
  shares the sender's authkey can reach, never an HTTP server.

Consumer, `deserialize_payload(text)`: an allow-list unpickler, never plain pickle on an HTTP body.
It admits only the torch rebuild functions, tensor/storage classes, dtypes and `torch.Size` that such a
payload uses; any other global raises `UnpicklingError` naming it. Every global the producer writes
is also on SGLang 0.5.23's `SafeUnpickler` allow-list (`sglang/srt/utils/common.py`), so a real
SGLang engine loads the same payload (tests/sglang_backend/test_sglang_cpu_server.py, tensor case).

    flat, views = flatten_bucket([("model.norm.weight", w)])
    body = {"serialized_named_tensors": [serialize_bucket(views)], "load_format": None}
    # engine side:
    named = deserialize_payload(body["serialized_named_tensors"][0])   # [(name, tensor)], mapped

Between two processes of this project that both outlive a sync (a trainer rank and the rollout manager
on one node), the sender keeps a `SharedSegment` (an anonymous memfd it maps), `shared_bucket(segment,
views)` describes a bucket in it by the segment's `/proc/<pid>/fd/<fd>` path and each tensor's place in
it, and the receiver's `SharedBucketReader` opens that path, maps the segment once and keeps its views:
a later sync sends the same few hundred bytes, and nothing is pickled by handle, mapped or unmapped
again. The views alias the sender's buffer, so each sync's copy into the buffer is what the receiver
reads. A memfd needs no `torch_shm_manager` (the daemon that torch's `file_system` segments start, ~110
MB of RSS for the run) and leaves nothing in /dev/shm: its memory goes when the last process holding it
maps or opens it no more, however the sender ends.
"""

from __future__ import annotations

import base64
import dataclasses
import io
import mmap
import os
import pickle
import secrets
import weakref
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch
import torch.multiprocessing.reductions as _reductions

# Byte alignment of each tensor inside a flat buffer (any dtype's element size divides it).
ALIGN = 64
# The argument of torch's CUDA tensor reduction that holds the device index (SGLang uses the same).
_CUDA_DEVICE_ARG = 6


def _aligned(t: torch.Tensor) -> int:
    return -(-t.numel() * t.element_size() // ALIGN) * ALIGN


def bucket_nbytes(bucket: list[tuple[str, torch.Tensor]]) -> int:
    """The bytes `flatten_bucket` needs for `bucket` (each tensor's start aligned to `ALIGN`)."""
    return sum(_aligned(t) for _, t in bucket)


def flatten_bucket(
    bucket: list[tuple[str, torch.Tensor]], buffer: torch.Tensor | None = None
) -> tuple[torch.Tensor, list[tuple[str, torch.Tensor]]]:
    """A flat uint8 buffer holding every tensor of `bucket`, and (name, view) pairs into it. The buffer
    is `buffer` when that is big enough and on the bucket's device (reuse it once the engines have
    copied the last bucket: fresh shared memory costs a page fault per page on both sides, which
    made a sync ~2x slower on a CPU); else a new one (on a CPU a shared-memory segment made for it)."""
    if not bucket:
        raise ValueError("an empty weight bucket has nothing to send")
    device = bucket[0][1].device
    offsets, total = [], 0
    for _, t in bucket:
        offsets.append(total)
        total += _aligned(t)
    if buffer is not None and buffer.device == device and buffer.numel() >= total:
        flat = buffer
    elif device.type == "cpu":
        storage = torch.UntypedStorage._new_using_filename_cpu(total)
        flat = torch.empty(0, dtype=torch.uint8).set_(storage, 0, (total,), (1,))
    else:
        flat = torch.empty(total, dtype=torch.uint8, device=device)
    views = []
    for (name, t), start in zip(bucket, offsets):
        nbytes = t.numel() * t.element_size()
        view = flat[start : start + nbytes].view(t.dtype).view(t.shape)
        view.copy_(t.detach())
        views.append((name, view))
    return flat, views


def _gpu_uuid(index: int) -> str:
    return str(torch.cuda.get_device_properties(index).uuid)


def _gpu_index(device: int | str) -> int:
    """The local index of a GPU named by UUID (or already by index) in this process."""
    if isinstance(device, int):
        return device
    for i in range(torch.cuda.device_count()):
        if _gpu_uuid(i) == device:
            return i
    raise RuntimeError(f"GPU {device} of a weight payload is not visible to this process (CUDA_VISIBLE_DEVICES); it is not colocated")


def _reduce_tensor(tensor: torch.Tensor):
    rebuild, args = _reductions.reduce_tensor(tensor)
    if tensor.is_cuda:
        args = (*args[:_CUDA_DEVICE_ARG], _gpu_uuid(args[_CUDA_DEVICE_ARG]), *args[_CUDA_DEVICE_ARG + 1 :])
    return rebuild, args


def _reduce_storage_by_filename(storage: torch.UntypedStorage):
    """torch's `file_system` branch of `reduce_storage`, whatever the process-wide strategy."""
    if storage.device.type != "cpu":
        raise RuntimeError("a CUDA storage travels inside its tensor's CUDA IPC handle, not by file name")
    manager, handle, size = storage._share_filename_cpu_()
    # Handed over to the consumer: its rebuild_storage_filename drops this reference once mapped.
    storage._shared_incref()
    _reductions.shared_cache[handle] = _reductions.StorageWeakRef(storage)
    return _reductions.rebuild_storage_filename, (type(storage), manager, handle, size)


class _HandlePickler(ForkingPickler):
    def __init__(self, file, protocol=None):
        super().__init__(file, protocol)
        self.dispatch_table[torch.Tensor] = _reduce_tensor
        self.dispatch_table[torch.nn.Parameter] = _reduce_tensor
        self.dispatch_table[torch.UntypedStorage] = _reduce_storage_by_filename


def serialize_bucket(views: list[tuple[str, torch.Tensor]]) -> str:
    """SGLang's `MultiprocessingSerializer.serialize(views, output_str=True)` with handles as above.
    Call once per engine TP rank: each consumer releases the references its own payload holds."""
    buf = io.BytesIO()
    _HandlePickler(buf).dump(list(views))
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _rebuild_cuda_tensor(*args):
    args = (*args[:_CUDA_DEVICE_ARG], _gpu_index(args[_CUDA_DEVICE_ARG]), *args[_CUDA_DEVICE_ARG + 1 :])
    return _reductions.rebuild_cuda_tensor(*args)


_R = "torch.multiprocessing.reductions"
# Exactly the globals `serialize_bucket` writes (checked by tests/rollout/test_tensor_ipc.py against
# real payloads), each also on SGLang 0.5.23's SafeUnpickler list.
ALLOWED_GLOBALS: dict[tuple[str, str], Any] = {
    (_R, "rebuild_tensor"): _reductions.rebuild_tensor,
    (_R, "rebuild_typed_storage"): _reductions.rebuild_typed_storage,
    (_R, "rebuild_storage_filename"): _reductions.rebuild_storage_filename,
    (_R, "rebuild_cuda_tensor"): _rebuild_cuda_tensor,
    ("torch", "Tensor"): torch.Tensor,
    ("torch.nn.parameter", "Parameter"): torch.nn.Parameter,
    ("torch.storage", "UntypedStorage"): torch.UntypedStorage,
    ("torch.storage", "TypedStorage"): torch.storage.TypedStorage,
    ("torch", "Size"): torch.Size,
}


class TensorPayloadUnpickler(pickle.Unpickler):
    """Unpickles a weight payload; refuses every global but the rebuild functions, classes and dtypes above."""

    def find_class(self, module: str, name: str):
        found = ALLOWED_GLOBALS.get((module, name))
        if found is not None:
            return found
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"weight payload refused: global {module}.{name} is not a tensor rebuild function or class")


def deserialize_payload(text: str | bytes) -> Any:
    """The object `serialize_bucket` wrote, its tensors mapped from their handles (validating base64)."""
    data = base64.b64decode(text, validate=True)
    return TensorPayloadUnpickler(io.BytesIO(data)).load()


class SharedSegment:
    """`size` bytes of CPU shared memory in an anonymous memfd this process keeps open (its fd) and
    mapped (`flat`, a uint8 tensor over the mapping), for `SharedBucketReader`s of other processes of
    this user on this host to map through `/proc/<pid>/fd/<fd>`. `name` is unique per segment, so a
    reader tells a new segment from an old one even where the fd number is reused."""

    def __init__(self, size: int):
        if size <= 0:
            raise ValueError("a shared segment needs at least one byte")
        self.size = size
        self.name = f"miles-weights-{secrets.token_hex(8)}"
        fd = os.memfd_create(self.name, os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, size)
            self._map = mmap.mmap(fd, size)
        except BaseException:
            os.close(fd)
            raise
        self.fd = fd
        self.path = f"/proc/{os.getpid()}/fd/{fd}"
        # The fd is what readers open; the mapping lives on in `flat` and its views after it closes.
        self._close_fd = weakref.finalize(self, os.close, fd)
        self.flat = torch.frombuffer(self._map, dtype=torch.uint8)

    def close(self) -> None:
        """Let readers that have not mapped the segment yet no longer open it (done when it is dropped)."""
        self._close_fd()


@dataclasses.dataclass(frozen=True)
class SharedBucket:
    """A bucket inside a `SharedSegment` its sender keeps: where another process opens the segment
    (`path`, `/proc/<pid>/fd/<fd>`), its unique `name` and `size`, and per tensor (name, dtype, shape,
    byte offset)."""

    path: str
    name: str
    size: int
    entries: tuple[tuple[str, str, tuple[int, ...], int], ...]


def shared_bucket(segment: SharedSegment, views: list[tuple[str, torch.Tensor]]) -> SharedBucket:
    """Describe `views` (from `flatten_bucket(bucket, segment.flat)`) by their places in `segment`."""
    base = segment.flat.data_ptr()
    entries = []
    for name, v in views:
        offset = v.data_ptr() - base
        if not 0 <= offset <= segment.size - v.numel() * v.element_size():
            raise ValueError(f"{name} does not lie in the shared segment {segment.name}")
        entries.append((name, str(v.dtype).removeprefix("torch."), tuple(v.shape), offset))
    return SharedBucket(segment.path, segment.name, segment.size, tuple(entries))


class SharedBucketReader:
    """The receiving end of `SharedBucket`s: maps the sender's segment once (again only when the sender
    moves to another, e.g. a larger one) and keeps one list of views per bucket layout."""

    def __init__(self) -> None:
        self._name: str | None = None
        self._flat: torch.Tensor | None = None
        self._views: dict[tuple, list[tuple[str, torch.Tensor]]] = {}

    def views(self, bucket: SharedBucket) -> list[tuple[str, torch.Tensor]]:
        """(name, tensor) pairs reading the segment's current contents (aliases, not copies)."""
        if bucket.name != self._name:
            self.release()
            self._flat = _map_segment(bucket)
            self._name = bucket.name
        views = self._views.get(bucket.entries)
        if views is None:
            views = []
            for name, dtype, shape, offset in bucket.entries:
                dt = getattr(torch, dtype)
                n = dt.itemsize
                for d in shape:
                    n *= d
                views.append((name, self._flat[offset : offset + n].view(dt).view(shape)))
            self._views[bucket.entries] = views
        return views

    def release(self) -> None:
        """Unmap the segment (the sender's copy keeps it alive for the sender)."""
        self._name, self._flat, self._views = None, None, {}


def _map_segment(bucket: SharedBucket) -> torch.Tensor:
    """The sender's segment, mapped here (read and write, as the sender maps it)."""
    try:
        fd = os.open(bucket.path, os.O_RDWR | os.O_CLOEXEC)
    except OSError as e:
        raise RuntimeError(f"cannot open the weight sender's shared segment {bucket.path} ({e.strerror}); "
                           "the sender must be a live process of this user on this host") from e
    try:
        # The fd number of a closed segment may name another file by now: only the segment named.
        if not os.readlink(f"/proc/self/fd/{fd}").startswith(f"/memfd:{bucket.name} "):
            raise RuntimeError(f"{bucket.path} is no longer the weight sender's segment {bucket.name}")
        mapping = mmap.mmap(fd, bucket.size)
    finally:
        os.close(fd)
    return torch.frombuffer(mapping, dtype=torch.uint8)
