"""Convert the torch backend's training checkpoints (DDP or FSDP2) to a Hugging Face model directory.

The torch trainer saves one `torch.distributed.checkpoint` per checkpoint (`.metadata` plus one
`__<rank>_0.distcp` per rank; miles/backends/torch/checkpoint.py) whose `model.*` entries are the
weights under their Hugging Face names, whole or sharded by FSDP2 over the ranks. This reads them one
tensor at a time in this process (DCP assembles a tensor's shards from every rank's file, so any world
size converts) and appends each to planned safetensors shards: memory is one tensor, not the model.
The optimizer, scheduler and RNG entries are not read.

What it is not: a reader for megatron-core's torch_dist (`metadata.json` next to `.metadata`); that
format has its own names and layout (torch_dist.py).
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from miles.ckpt.convert.hf_io import ShardedSafetensorsWriter

if TYPE_CHECKING:
    import torch

DCP_METADATA = ".metadata"
MEGATRON_MARKER = "metadata.json"
_PREFIX = "model."


def is_torch_backend_checkpoint(directory: Path) -> bool:
    """A torch DCP checkpoint that megatron-core did not write (it adds metadata.json)."""
    return (directory / DCP_METADATA).is_file() and not (directory / MEGATRON_MARKER).is_file()


def plan(ckpt: Path, hf_config: dict) -> list[tuple[str, tuple[int, ...], "torch.dtype"]]:
    """(HF name, shape, dtype) of every weight in `ckpt`, in stored order. A tied `lm_head.weight` is
    left out, as Hugging Face saves a tied model."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    meta = dcp.FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata
    tied = bool(hf_config.get("tie_word_embeddings", False))
    return [
        (key[len(_PREFIX):], tuple(m.size), m.properties.dtype)
        for key, m in meta.items()
        if key.startswith(_PREFIX) and isinstance(m, TensorStorageMetadata)
        and not (tied and key == _PREFIX + "lm_head.weight")
    ]


def write_hf_weights(ckpt: Path, out: Path, planned: list, chunk_size: int,
                     advance: Callable[[int, int], None] = lambda _t, _b: None) -> None:
    """Write the `planned` tensors of `ckpt` as safetensors shards into `out`, the index last."""
    import torch
    import torch.distributed.checkpoint as dcp

    writer = ShardedSafetensorsWriter(out, planned, chunk_size)
    try:
        for name, size, dtype in planned:
            tensor = torch.empty(size, dtype=dtype)
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
                dcp.load({"model": {name: tensor}}, checkpoint_id=str(ckpt), no_dist=True)
            writer.write(name, tensor)
            advance(1, tensor.numel() * tensor.element_size())
            del tensor
    except BaseException:
        writer.abort()
        raise
    writer.write_index()  # last: the completion sentinel of an HF export
