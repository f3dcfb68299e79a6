"""Write and read megatron-core `torch_dist` checkpoints of a GPTModel without building the model.

`save_torch_dist(tensors, ckpt_dir, shape)` turns (megatron local name, tensor) pairs into the
`ShardedTensor`s a local-spec GPTModel's `sharded_state_dict()` would produce (see layout.py) and saves
them with `megatron.core.dist_checkpointing`. `TorchDistReader(ckpt_dir, shape)` reads tensors back,
one layer at a time, by asking `dist_checkpointing.load` for exactly those shards.

Memory: reading is streamed (one tensor at a time). Writing is NOT: megatron-core's
`dist_checkpointing.save` takes one state dict for the whole checkpoint (its metadata and
validation span all shards), so the writer holds the converted model in memory once.

Both need Saving needs `torch.distributed`; with no process group yet, a private single-process gloo
group is opened for the call and closed after it (`single_process_group`). megatron-core's writer
starts a `spawn` multiprocessing manager, so a script calling it needs `if __name__ == "__main__":`.
"""

from __future__ import annotations

import contextlib
import io
import json
import socket
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Iterable, Iterator

from miles.ckpt.convert.families import ModelShape
from miles.ckpt.convert.layout import ShardedKey, extra_state_keys, megatron_shapes, sharded_key
from miles.ckpt.convert.mapping import rules_for
from miles.ckpt.megatron_compat import cpu_compat
from miles.errors import UserError

if TYPE_CHECKING:
    import torch

TRACKER = "latest_checkpointed_iteration.txt"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def single_process_group() -> Iterator[None]:
    """A world-size-1 gloo group for the duration of the block, unless one already exists."""
    import torch.distributed as dist

    if dist.is_initialized():
        if dist.get_world_size() != 1:
            raise RuntimeError("checkpoint conversion runs in one process; call it outside a multi-rank job")
        yield
        return
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1, timeout=timedelta(seconds=120)
    )
    try:
        yield
    finally:
        dist.destroy_process_group()


def _sharded_tensor(sk: ShardedKey, tensor: torch.Tensor):
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    return ShardedTensor.from_rank_offsets(sk.key, tensor, *sk.prepend, replica_id=0, prepend_axis_num=len(sk.prepend))


def save_torch_dist(tensors: Iterable[tuple[str, torch.Tensor]], ckpt_dir: Path, shape: ModelShape) -> None:
    """Save megatron-named tensors as a torch_dist checkpoint in `ckpt_dir` (which must exist)."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    sharded: dict[str, object] = {}
    for name, tensor in tensors:
        sharded[name] = _sharded_tensor(sharded_key(name, shape), tensor)
    for sk in extra_state_keys(rules_for(shape), shape):
        offset = tuple(p[1] for p in sk.prepend)
        sharded[f"{sk.key}/{offset}"] = ShardedObject(sk.key, None, tuple(p[2] for p in sk.prepend), offset, replica_id=0)
    with cpu_compat(), single_process_group():
        dist_checkpointing.save(sharded, str(ckpt_dir), sharded_strategy=("torch_dist", 1))


def resolve_checkpoint_dir(load: Path) -> Path:
    """`--load DIR` -> the directory holding the dist checkpoint (via the tracker file, like Megatron)."""
    if (load / "metadata.json").is_file():
        return load
    tracker = load / TRACKER
    if not tracker.is_file():
        raise UserError(
            f"--load {load} has no {TRACKER} and no metadata.json, so it is not a (complete) torch_dist "
            "checkpoint; pass the directory written by `miles convert --to torch_dist` or a training save."
        )
    text = tracker.read_text().strip()
    sub = load / ("release" if text == "release" else f"iter_{int(text):07d}")
    if not (sub / "metadata.json").is_file():
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
        from torch.distributed.checkpoint import FileSystemReader

        backend = json.loads((self.ckpt_dir / "metadata.json").read_text()).get("sharded_backend")
        if backend != "torch_dist":
            raise UserError(f"{self.ckpt_dir} is a {backend} checkpoint; miles convert reads torch_dist only.")
        self.metadata = FileSystemReader(str(self.ckpt_dir)).read_metadata()
        self._check_metadata()
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def _check_metadata(self) -> None:
        stored = {k: tuple(v.size) for k, v in self.metadata.state_dict_metadata.items() if hasattr(v, "chunks")}
        expected: dict[str, tuple[int, ...]] = {}
        for name, local in self.shapes.items():
            sk = sharded_key(name, self.shape)
            expected[sk.key] = tuple(p[2] for p in sk.prepend) + local
        problems = [f"{k} is missing" for k in expected if k not in stored]
        problems += [f"{k} has shape {list(stored[k])}, config implies {list(v)}"
                     for k, v in expected.items() if k in stored and stored[k] != v]
        if problems:
            shown = "; ".join(problems[:8]) + (f"; and {len(problems) - 8} more" if len(problems) > 8 else "")
            raise UserError(
                f"The torch_dist checkpoint {self.ckpt_dir} does not match the HF config ({self.shape.architecture}): "
                f"{shown}; pass the --origin-hf-dir this checkpoint was converted from."
            )

    def stored_dtype(self) -> torch.dtype:
        return self.metadata.state_dict_metadata["embedding.word_embeddings.weight"].properties.dtype

    def read(self, names: list[str]) -> dict[str, torch.Tensor]:
        return {n: self._read_one(n) for n in names}

    def _read_one(self, name: str) -> torch.Tensor:
        import torch
        from torch.distributed.checkpoint.metadata import MetadataIndex

        sk = sharded_key(name, self.shape)
        meta = self.metadata.state_dict_metadata[sk.key]
        lo = [p[1] for p in sk.prepend] + [0] * len(self.shapes[name])
        hi = [p[1] + 1 for p in sk.prepend] + list(self.shapes[name])
        out = torch.empty(self.shapes[name], dtype=meta.properties.dtype)
        view = out.reshape([1] * len(sk.prepend) + list(self.shapes[name]))
        covered = 0
        for chunk in meta.chunks:
            c_lo, c_hi = list(chunk.offsets), [o + s for o, s in zip(chunk.offsets, chunk.sizes)]
            a = [max(x, y) for x, y in zip(lo, c_lo)]
            b = [min(x, y) for x, y in zip(hi, c_hi)]
            if any(x >= y for x, y in zip(a, b)):
                continue
            info = self.metadata.storage_data[MetadataIndex(sk.key, chunk.offsets)]
            if info.transform_descriptors:
                raise NotImplementedError(f"{sk.key}: DCP storage transforms {info.transform_descriptors} are not supported")
            with open(self.ckpt_dir / info.relative_path, "rb") as f:
                f.seek(info.offset)
                data = torch.load(io.BytesIO(f.read(info.length)), map_location="cpu", weights_only=True)
            src = data[tuple(slice(x - c, y - c) for x, y, c in zip(a, b, c_lo))]
            view[tuple(slice(x - l, y - l) for x, y, l in zip(a, b, lo))] = src
            covered += src.numel()
        if covered != out.numel():
            raise RuntimeError(f"{self.ckpt_dir}: stored chunks cover {covered} of {out.numel()} elements of {name}")
        return out
