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
on one node), `shared_bucket(flat, views)` describes a bucket in a buffer the sender keeps by the
segment's name and each tensor's place in it, and the receiver's `SharedBucketReader` maps that segment
once and keeps its views: a later sync sends the same few hundred bytes, and nothing is pickled by
handle, mapped or unmapped again. The views alias the sender's buffer, so each sync's copy into the
buffer is what the receiver reads.
"""

from __future__ import annotations

import base64
import dataclasses
import io
import pickle
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch
import torch.multiprocessing.reductions as _reductions

# Byte alignment of each tensor inside a flat buffer (any dtype's element size divides it).
ALIGN = 64
# The argument of torch's CUDA tensor reduction that holds the device index (SGLang uses the same).
_CUDA_DEVICE_ARG = 6


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
        total += -(-t.numel() * t.element_size() // ALIGN) * ALIGN
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


@dataclasses.dataclass(frozen=True)
class SharedBucket:
    """A bucket inside a CPU shared-memory segment its sender keeps: torch's `file_system` names of the
    segment (`manager`, `handle`, `size`, as `UntypedStorage._share_filename_cpu_` gives them) and per
    tensor (name, dtype, shape, byte offset)."""

    manager: bytes
    handle: bytes
    size: int
    entries: tuple[tuple[str, str, tuple[int, ...], int], ...]


def shared_bucket(flat: torch.Tensor, views: list[tuple[str, torch.Tensor]]) -> SharedBucket:
    """Describe `views` (from `flatten_bucket`) by their places in `flat`, a CPU shared-memory buffer."""
    storage = flat.untyped_storage()
    if storage.device.type != "cpu":
        raise RuntimeError("a shared bucket lives in CPU shared memory; a CUDA bucket travels as IPC handles (serialize_bucket)")
    manager, handle, size = storage._share_filename_cpu_()
    base = flat.data_ptr()
    entries = tuple(
        (name, str(v.dtype).removeprefix("torch."), tuple(v.shape), v.data_ptr() - base) for name, v in views
    )
    return SharedBucket(manager, handle, size, entries)


class SharedBucketReader:
    """The receiving end of `SharedBucket`s: maps the sender's segment once (again only when the sender
    moves to another, e.g. a larger one) and keeps one list of views per bucket layout."""

    def __init__(self) -> None:
        self._handle: bytes | None = None
        self._flat: torch.Tensor | None = None
        self._views: dict[tuple, list[tuple[str, torch.Tensor]]] = {}

    def views(self, bucket: SharedBucket) -> list[tuple[str, torch.Tensor]]:
        """(name, tensor) pairs reading the segment's current contents (aliases, not copies)."""
        if bucket.handle != self._handle:
            self.release()
            storage = torch.UntypedStorage._new_shared_filename_cpu(bucket.manager, bucket.handle, bucket.size)
            self._flat = torch.empty(0, dtype=torch.uint8).set_(storage, 0, (bucket.size,), (1,))
            self._handle = bucket.handle
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
        self._handle, self._flat, self._views = None, None, {}
