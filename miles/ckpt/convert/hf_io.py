"""Stream Hugging Face safetensors checkpoints: read one tensor at a time, write shards incrementally.

`HFReader(dir, shape)` opens `model.safetensors` or the shards named by `model.safetensors.index.json`
with `safetensors.safe_open` and returns tensors on demand; on open it checks that every shard file
exists and every tensor the config implies is present with the right shape (all problems in one
`UserError`). `ShardedSafetensorsWriter` plans the shards up front from the known names, shapes and
dtypes, writes each shard's header first and then appends tensor bytes as they arrive, so no shard is
ever held in memory. `write_index` writes `model.safetensors.index.json` (the completion sentinel,
written last by the converter).

What it is not: a general safetensors library: tensors must arrive in the planned order.
"""

from __future__ import annotations

import contextlib
import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from miles.ckpt.convert.families import ModelShape
from miles.ckpt.convert.layout import hf_shapes
from miles.errors import UserError

if TYPE_CHECKING:
    import torch

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
# Files copied next to converted weights so the output is a loadable HF model directory.
HF_ASSET_FILES = (
    "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
    "special_tokens_map.json", "vocab.json", "merges.txt", "tokenizer.model", "added_tokens.json", "chat_template.jinja",
)

_ST_DTYPES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16", "float64": "F64", "int64": "I64", "int32": "I32",
              "int8": "I8", "uint8": "U8", "bool": "BOOL", "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2"}


def _short(items: list[str], n: int = 6) -> str:
    return ", ".join(items[:n]) + (f" and {len(items) - n} more" if len(items) > n else "")


def read_hf_config(directory: Path) -> dict:
    path = directory / "config.json"
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise UserError(f"{directory} has no config.json; pass a Hugging Face model directory.") from None
    except (OSError, json.JSONDecodeError) as e:
        raise UserError(f"{path} cannot be read ({e}); fix or replace the file.") from None


class HFReader:
    """Tensor-at-a-time access to a HF checkpoint, validated against the config's implied shapes."""

    def __init__(self, directory: Path, shape: ModelShape):
        self.directory, self.shape = directory, shape
        self._stack = contextlib.ExitStack()
        self._handles: dict[str, object] = {}
        self.weight_map = self._weight_map()

    def _weight_map(self) -> dict[str, str]:
        index = self.directory / INDEX
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (OSError, json.JSONDecodeError, KeyError) as e:
                raise UserError(f"{index} is not a valid safetensors index ({e}); re-download the checkpoint.") from None
        elif (self.directory / SINGLE).is_file():
            from safetensors import safe_open

            with safe_open(self.directory / SINGLE, framework="pt") as f:
                weight_map = {k: SINGLE for k in f.keys()}
        else:
            raise UserError(f"{self.directory} has neither {SINGLE} nor {INDEX}; pass a directory with safetensors weights.")
        missing_files = sorted({f for f in weight_map.values() if not (self.directory / f).is_file()})
        if missing_files:
            raise UserError(f"{self.directory} is incomplete: {INDEX} lists missing shard files {_short(missing_files)}; finish the download.")
        return weight_map

    def __enter__(self) -> HFReader:
        self.validate()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()
        self._handles.clear()

    def _handle(self, file: str):
        if file not in self._handles:
            from safetensors import safe_open

            self._handles[file] = self._stack.enter_context(safe_open(self.directory / file, framework="pt"))
        return self._handles[file]

    def validate(self) -> None:
        expected = hf_shapes(self.shape)
        missing = [n for n in expected if n not in self.weight_map]
        problems = [f"missing tensors {_short(missing)}"] if missing else []
        for name, want in expected.items():
            if name in self.weight_map:
                got = tuple(self._handle(self.weight_map[name]).get_slice(name).get_shape())
                if got != want:
                    problems.append(f"{name} has shape {list(got)}, config implies {list(want)}")
        if problems:
            raise UserError(f"{self.directory} does not match its config.json ({self.shape.architecture}): "
                            f"{_short(problems, 8)}; the checkpoint is partial or the config is wrong.")

    def get(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        # A fresh handle per tensor, closed at once: safe_open maps the whole file, and pages read
        # through a long-lived handle stay resident (and counted in the process RSS) until it closes,
        # which for a full pass is the whole checkpoint. Header queries keep the cached handles.
        with safe_open(self.directory / self.weight_map[name], framework="pt") as f:
            return f.get_tensor(name)

    def dtype(self, name: str) -> torch.dtype:
        """The stored dtype, from the safetensors header (no data is read)."""
        import torch

        code = self._handle(self.weight_map[name]).get_slice(name).get_dtype()
        return getattr(torch, {v: k for k, v in _ST_DTYPES.items()}[code])

    def nbytes(self, name: str) -> int:
        import torch

        n = 1
        for d in self._handle(self.weight_map[name]).get_slice(name).get_shape():
            n *= d
        return n * torch.empty((), dtype=self.dtype(name)).element_size()


@dataclass
class _Shard:
    file: str
    names: list[str]
    header: dict
    size: int


class ShardedSafetensorsWriter:
    """Writes planned tensors into `model-XXXXX-of-YYYYY.safetensors` shards of at most `chunk_size` bytes."""

    def __init__(self, directory: Path, plan: list[tuple[str, tuple[int, ...], torch.dtype]], chunk_size: int):
        import torch

        self.directory = directory
        groups: list[list[tuple[str, tuple[int, ...], torch.dtype, int]]] = [[]]
        size = 0
        for name, shp, dtype in plan:
            n = torch.Size(shp).numel() * torch.empty((), dtype=dtype).element_size()
            if groups[-1] and size + n > chunk_size:  # a tensor larger than chunk_size gets its own shard
                groups.append([])
                size = 0
            groups[-1].append((name, shp, dtype, n))
            size += n
        self.shards: list[_Shard] = []
        for i, g in enumerate(groups):
            header: dict = {"__metadata__": {"format": "pt"}}
            offset = 0
            for name, shp, dtype, n in g:
                header[name] = {"dtype": _ST_DTYPES[str(dtype).removeprefix("torch.")], "shape": list(shp),
                                "data_offsets": [offset, offset + n]}
                offset += n
            file = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
            self.shards.append(_Shard(file, [x[0] for x in g], header, offset))
        self._order = [(s, n) for s in self.shards for n in s.names]
        self._pos = 0
        self._fh = None

    def write(self, name: str, tensor: torch.Tensor) -> None:
        import torch

        shard, expected = self._order[self._pos]
        if name != expected:
            raise RuntimeError(f"tensor {name} arrived out of the planned order (expected {expected})")
        meta = shard.header[name]
        if list(tensor.shape) != meta["shape"] or _ST_DTYPES[str(tensor.dtype).removeprefix("torch.")] != meta["dtype"]:
            raise RuntimeError(f"{name}: got {tuple(tensor.shape)} {tensor.dtype}, planned {meta['shape']} {meta['dtype']}")
        if shard.names[0] == name:
            self._open(shard)
        data = tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
        self._fh.write(memoryview(data))
        self._pos += 1
        if shard.names[-1] == name:
            self._fh.close()
            self._fh = None

    def _open(self, shard: _Shard) -> None:
        header = json.dumps(shard.header, separators=(",", ":")).encode()
        header += b" " * (-len(header) % 8)  # the data section starts 8-byte aligned
        self._fh = open(self.directory / shard.file, "wb")
        self._fh.write(struct.pack("<Q", len(header)) + header)

    def write_index(self) -> None:
        if self._pos != len(self._order):
            raise RuntimeError(f"only {self._pos} of {len(self._order)} planned tensors were written")
        weight_map = {n: s.file for s in self.shards for n in s.names}
        index = {"metadata": {"total_size": sum(s.size for s in self.shards)}, "weight_map": weight_map}
        (self.directory / INDEX).write_text(json.dumps(index, indent=2) + "\n")
