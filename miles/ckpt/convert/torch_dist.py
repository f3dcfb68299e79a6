"""Write and read megatron-core `torch_dist` checkpoints of a GPTModel without building the model.

`save_torch_dist(plan, produce, ckpt_dir, shape)` writes the checkpoint a local-spec GPTModel's
`sharded_state_dict()` would save (same keys, stacked layer/expert axes, chunks, `_extra_state`
objects, `metadata.json`, `common.pt`; see layout.py), asking `produce(name)` for each tensor only
when its bytes are written. `TorchDistReader(ckpt_dir, shape)` reads tensors back one at a time.

`TorchDistReader.source(name)` says where a tensor's bytes lie in the files, as byte ranges (no
torch), whatever TP layout wrote the chunks; `read` assembles the tensor with torch (the megatron
trainer's loader).

Memory: both directions hold at most one tensor at a time, and `miles convert` none: megatron-core's
own `dist_checkpointing.save` stages the whole sharded state dict before its writer starts, and
torch's `FileSystemWriter` keeps every tensor of a file alive until the file is closed. So the writer
here is dcp_stream.py, which writes torch DCP's format item by item without importing torch (its
records are byte ranges copied by the kernel); a new `__0_N.distcp` file starts every `file_bytes`. Tests check that the `.metadata` index equals the one megatron-core's
`dist_checkpointing.save` writes for the same tensors, and that `dist_checkpointing.load` reads the
result into a GPTModel at TP1 and TP2. Converting does not import megatron-core at all (nor need its
CPU patches); the tests use it as the oracle.

What it is not: a writer for training checkpoints (optimizer state, several ranks): conversion runs in
one process and writes whole (TP=1) tensors; megatron-core slices them at load time.
"""

from __future__ import annotations

import io
import itertools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

from miles.ckpt.convert import bytecopy
from miles.ckpt.convert.families import ModelShape
from miles.ckpt.convert.layout import ShardedKey, extra_state_keys, megatron_shapes, sharded_key
from miles.ckpt.convert.mapping import rules_for
from miles.ckpt.convert.torch_format import NotPlain, dtype_of, numel, object_record, read_tensor_record
from miles.errors import UserError

if TYPE_CHECKING:
    import torch

TRACKER = "latest_checkpointed_iteration.txt"
# The two small files megatron-core's dist_checkpointing.save writes next to the DCP data
# (megatron-core 0.16.1: core.CONFIG_FNAME with save_config's JSON, strategies.common.COMMON_STATE_FNAME).
# Written here so that converting never imports megatron-core (about 4 s); a test compares them
# byte for byte with megatron-core's own output.
CONFIG = "metadata.json"
COMMON_STATE = "common.pt"
MEGATRON_CONFIG = {"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch",
                   "common_backend_version": 1}
# A new .distcp file is started once the current one holds this many bytes: few files for a large
# model, and a partly written file never holds more than one tensor past this.
FILE_BYTES = 4 * 1024**3


@dataclass(frozen=True)
class PlannedTensor:
    """A megatron-core tensor (local-spec name, whole TP=1 shape) to be written, known before its data."""

    name: str
    shape: tuple[int, ...]
    dtype: Any  # a dtype name ("float32") or a torch.dtype


def save_torch_dist(plan: Sequence[PlannedTensor], produce: Callable[[str], Any], ckpt_dir: Path,
                    shape: ModelShape, *, file_bytes: int = FILE_BYTES) -> None:
    """Write a torch_dist checkpoint into `ckpt_dir` (created if missing), one tensor at a time.

    `produce(name)` is called once per planned tensor, in plan order, and must return the planned
    shape and dtype: a `bytecopy.Source` (file ranges the kernel copies) or a torch tensor (dropped as
    soon as its bytes are written). Every file is on disk before `metadata.json`, the marker of a
    complete dist checkpoint, is written.
    """
    from miles.ckpt.convert import dcp_stream

    items: list[dcp_stream.Item] = []
    for p in plan:
        sk = sharded_key(p.name, shape)
        # One chunk per tensor, as megatron-core's translation produces: a stacked key gets one per layer.
        items.append(dcp_stream.Item(sk.key, tuple([o for _, o, _ in sk.prepend] + [0] * len(p.shape)),
                                     tuple([n for _, _, n in sk.prepend] + list(p.shape)), p.name, tuple(p.shape), p.dtype))
    empty = object_record([None])  # megatron-core stores a ShardedObject as torch.save([data])
    for sk in extra_state_keys(rules_for(shape), shape):
        # The local spec's linear layers have an `_extra_state` of None, stored under its unique key.
        items.append(dcp_stream.Item(sharded_object_key(sk), data=empty))
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    dcp_stream.save(items, produce, ckpt_dir, file_bytes)
    # What megatron-core saves for a state dict with no common part: torch.save({}).
    bytecopy.write_durably(ckpt_dir / COMMON_STATE, object_record({}, archive=COMMON_STATE.removesuffix(".pt")))
    # Last: megatron-core's marker that the directory is a complete dist checkpoint.
    bytecopy.write_durably(ckpt_dir / CONFIG, json.dumps(MEGATRON_CONFIG).encode())
    bytecopy.fsync_dir(ckpt_dir)


def sharded_object_key(sk: ShardedKey) -> str:
    """megatron-core's `ShardedObject.unique_key`: `<key>/shard_<offsets>_<shape>` (dot-joined)."""
    offsets = ".".join(str(o) for _, o, _ in sk.prepend)
    sizes = ".".join(str(n) for _, _, n in sk.prepend)
    return f"{sk.key}/shard_{offsets}_{sizes}"


def resolve_checkpoint_dir(load: Path) -> Path:
    """`--load DIR` -> the directory holding the dist checkpoint (via the tracker file, like Megatron)."""
    if (load / CONFIG).is_file():
        return load
    tracker = load / TRACKER
    if not tracker.is_file():
        raise UserError(
            f"--load {load} has no {TRACKER} and no {CONFIG}, so it is not a (complete) torch_dist "
            "checkpoint; pass the directory written by `miles convert --to torch_dist` or a training save."
        )
    text = tracker.read_text().strip()
    sub = load / ("release" if text == "release" else f"iter_{int(text):07d}")
    if not (sub / CONFIG).is_file():
        raise UserError(f"--load {load}: {TRACKER} points at {sub.name}, which is missing or incomplete; re-run the conversion or save.")
    return sub


class TorchDistReader:
    """Reads megatron-named tensors from a torch_dist checkpoint, checking shapes against the config.

    megatron-core's `dist_checkpointing.load` cannot load one layer of a stacked tensor in a single
    process (it insists that every fragment of a global tensor is requested by some rank), so this
    reads the torch DCP files directly: the `.metadata` index gives, for each global tensor, its
    stored chunks (whatever TP layout wrote them) and where their bytes lie; a request assembles its
    slice from the overlapping chunks. Memory is the requested tensors plus one chunk.
    """

    def __init__(self, ckpt_dir: Path, shape: ModelShape):
        self.ckpt_dir, self.shape = ckpt_dir, shape
        self.shapes = megatron_shapes(shape)

    def __enter__(self) -> TorchDistReader:
        from miles.ckpt.convert.dcp_stream import read_metadata

        backend = json.loads((self.ckpt_dir / CONFIG).read_text()).get("sharded_backend")
        if backend != "torch_dist":
            raise UserError(f"{self.ckpt_dir} is a {backend} checkpoint; miles convert reads torch_dist only.")
        self.metadata = read_metadata(self.ckpt_dir)
        self._files: dict[str, Any] = {}
        self._check_metadata()
        return self

    def __exit__(self, *exc: object) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()

    def _check_metadata(self) -> None:
        stored = {k: tuple(v.size) for k, v in self.metadata.state_dict_metadata.items() if hasattr(v, "chunks")}
        expected: dict[str, tuple[int, ...]] = {}
        for name, local in self.shapes.items():
            sk = sharded_key(name, self.shape)
            expected[sk.key] = tuple(p[2] for p in sk.prepend) + local
        problems = [f"{k} is missing" for k in expected if k not in stored]
        problems += [f"{k} has shape {list(stored[k])}, config implies {list(v)}"
                     for k, v in expected.items() if k in stored and stored[k] != v and not _padded_vocab(k, stored[k], v)]
        if problems:
            shown = "; ".join(problems[:8]) + (f"; and {len(problems) - 8} more" if len(problems) > 8 else "")
            raise UserError(
                f"The torch_dist checkpoint {self.ckpt_dir} does not match the HF config ({self.shape.architecture}): "
                f"{shown}; pass the --origin-hf-dir this checkpoint was converted from."
            )

    def stored_dtype(self) -> str:
        """The dtype name ("bfloat16") of the stored embedding."""
        return dtype_of(self.metadata.state_dict_metadata["embedding.word_embeddings.weight"].properties.dtype).name

    def source(self, name: str) -> bytecopy.Source | None:
        """Where tensor `name`'s bytes lie in the files, in row-major order; None to use `read` instead.

        Any chunk layout: a TP=1 save (ours) is one range per tensor, a vocabulary padded at the end a
        prefix of one, a TP>1 save's column-parallel chunks a few ranges, its row-parallel chunks one
        range per row and chunk. None only for records that are not plain `torch.save`d tensors.
        """
        sk = sharded_key(name, self.shape)
        meta = self.metadata.state_dict_metadata[sk.key]
        dims = [1] * len(sk.prepend) + list(self.shapes[name])
        lo = [p[1] for p in sk.prepend] + [0] * len(self.shapes[name])
        n = len(dims)
        runs: list[tuple[int, bytecopy.Segment]] = []  # (byte offset in the requested tensor, where it lies)
        dtype = None
        for chunk in meta.chunks:
            c_lo, c_sz = list(chunk.offsets), list(chunk.sizes)
            a = [max(x, c) for x, c in zip(lo, c_lo)]
            b = [min(x + d, c + s) for x, d, c, s in zip(lo, dims, c_lo, c_sz)]
            if any(x >= y for x, y in zip(a, b)):
                continue
            loc = self._locate(sk.key, chunk)
            if loc is None or loc.shape != tuple(c_sz) or (dtype is not None and loc.dtype != dtype):
                return None
            dtype = loc.dtype
            ext = [y - x for x, y in zip(a, b)]
            # Runs are contiguous in both the chunk and the request: the trailing dimensions that
            # both span whole, and one more.
            k = n - 1
            while k > 0 and ext[k] == c_sz[k] == dims[k]:
                k -= 1
            run = numel(ext[k:]) * dtype.itemsize
            c_stride, r_stride = _strides(c_sz), _strides(dims)
            for idx in itertools.product(*(range(a[i], b[i]) for i in range(k))):
                at = list(idx) + a[k:]
                src = sum((p - c) * st for p, c, st in zip(at, c_lo, c_stride))
                dst = sum((p - x) * st for p, x, st in zip(at, lo, r_stride))
                runs.append((dst * dtype.itemsize, bytecopy.Segment(loc.path, loc.offset + src * dtype.itemsize, run)))
        runs.sort(key=lambda r: r[0])
        pos = 0
        for dst, seg in runs:
            if dst != pos:
                return None  # a gap or an overlap: the stored chunks do not tile the tensor
            pos += seg.nbytes
        if dtype is None or pos != numel(dims) * dtype.itemsize:
            return None
        return bytecopy.Source(dtype.name, tuple(self.shapes[name]), bytecopy.merged([seg for _, seg in runs]))

    def _locate(self, key: str, chunk) -> _Located | None:
        info = self.metadata.storage_data[_metadata_index(key, chunk.offsets)]
        if getattr(info, "transform_descriptors", None):
            return None
        path = self.ckpt_dir / info.relative_path
        if info.relative_path not in self._files:
            self._files[info.relative_path] = open(path, "rb")
        try:
            loc = read_tensor_record(self._files[info.relative_path], info.offset, info.length)
        except NotPlain:
            return None
        return _Located(path, loc.dtype, loc.shape, loc.offset)

    def read(self, names: list[str]) -> dict[str, torch.Tensor]:
        return {n: self._read_one(n) for n in names}

    def _read_one(self, name: str) -> torch.Tensor:
        import torch

        sk = sharded_key(name, self.shape)
        meta = self.metadata.state_dict_metadata[sk.key]
        if name in _VOCAB_KEYS and meta.size[0] > self.shapes[name][0]:
            # A training checkpoint's vocabulary is padded to a multiple of its TP size; the padding rows
            # are not part of the model (megatron trainer: miles/backends/megatron/model.py).
            return self._read_padded(sk.key, meta, name)
        lo = [p[1] for p in sk.prepend] + [0] * len(self.shapes[name])
        hi = [p[1] + 1 for p in sk.prepend] + list(self.shapes[name])
        for chunk in meta.chunks:
            if list(chunk.offsets) == lo and [o + s for o, s in zip(chunk.offsets, chunk.sizes)] == hi:
                # Stored exactly as requested (a TP=1 save, e.g. ours): no assembly buffer, no copy.
                return self._load_chunk(sk.key, chunk).reshape(self.shapes[name])
        out = torch.empty(self.shapes[name], dtype=_torch_dtype(meta.properties.dtype))
        view = out.reshape([1] * len(sk.prepend) + list(self.shapes[name]))
        covered = 0
        for chunk in meta.chunks:
            c_lo, c_hi = list(chunk.offsets), [o + s for o, s in zip(chunk.offsets, chunk.sizes)]
            a = [max(x, y) for x, y in zip(lo, c_lo)]
            b = [min(x, y) for x, y in zip(hi, c_hi)]
            if any(x >= y for x, y in zip(a, b)):
                continue
            data = self._load_chunk(sk.key, chunk)
            src = data[tuple(slice(x - c, y - c) for x, y, c in zip(a, b, c_lo))]
            view[tuple(slice(x - l, y - l) for x, y, l in zip(a, b, lo))] = src
            covered += src.numel()
        if covered != out.numel():
            raise RuntimeError(f"{self.ckpt_dir}: stored chunks cover {covered} of {out.numel()} elements of {name}")
        return out

    def _read_padded(self, key: str, meta, name: str) -> torch.Tensor:
        import torch

        rows = self.shapes[name][0]
        out = torch.empty(tuple(meta.size), dtype=_torch_dtype(meta.properties.dtype))
        for chunk in meta.chunks:
            out[tuple(slice(o, o + n) for o, n in zip(chunk.offsets, chunk.sizes))] = self._load_chunk(key, chunk)
        return out[:rows].clone()

    def _load_chunk(self, key: str, chunk) -> torch.Tensor:
        import torch

        info = self.metadata.storage_data[_metadata_index(key, chunk.offsets)]
        if getattr(info, "transform_descriptors", None):
            raise NotImplementedError(f"{key}: DCP storage transforms {info.transform_descriptors} are not supported")
        # torch.load reads the record straight from the file into the tensor: no bytes copy in between.
        with open(self.ckpt_dir / info.relative_path, "rb") as f:
            return torch.load(_FileSlice(f, info.offset, info.length), map_location="cpu", weights_only=True)


_VOCAB_KEYS = ("embedding.word_embeddings.weight", "output_layer.weight")


@dataclass(frozen=True)
class _Located:
    path: Path
    dtype: Any  # torch_format.DType
    shape: tuple[int, ...]
    offset: int


def _strides(shape: list[int]) -> list[int]:
    out, acc = [], 1
    for s in reversed(shape):
        out.append(acc)
        acc *= s
    return out[::-1]


def _metadata_index(key: str, offsets) -> Any:
    from miles.ckpt.convert.dcp_stream import MetadataIndex

    return MetadataIndex(key, offsets)


def _torch_dtype(dtype: Any) -> torch.dtype:
    import torch

    return getattr(torch, dtype_of(dtype).name)


def _padded_vocab(key: str, stored: tuple[int, ...], expected: tuple[int, ...]) -> bool:
    """A vocabulary tensor with extra (padding) rows and otherwise the expected shape."""
    return key in _VOCAB_KEYS and len(stored) == len(expected) and stored[1:] == expected[1:] and stored[0] > expected[0]


class _FileSlice(io.RawIOBase):
    """A read-only, seekable window [offset, offset + length) of an open file: one torch.save archive."""

    def __init__(self, f: io.BufferedReader, offset: int, length: int):
        self._f, self._start, self._len, self._pos = f, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._len}[whence]
        self._pos = min(max(base + pos, 0), self._len)
        return self._pos

    def readinto(self, buf) -> int:
        n = min(len(buf), self._len - self._pos)
        if n <= 0:
            return 0
        self._f.seek(self._start + self._pos)
        got = self._f.readinto(memoryview(buf)[:n])
        self._pos += got
        return got
