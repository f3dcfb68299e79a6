"""Stream Hugging Face safetensors checkpoints: read one tensor at a time, write shards incrementally.

`HFReader(dir, shape)` reads the headers of `model.safetensors` or of the shards named by
`model.safetensors.index.json` (an 8-byte length and JSON: no torch, no data read) and says where each
tensor's bytes lie (`source`); on open it checks that every shard file exists and every tensor the
config implies is present with the right shape, dtype and byte range (all problems in one `UserError`).
`ShardedSafetensorsWriter` plans the shards up front from the known names, shapes and dtypes, writes
each shard's header first and then appends tensor bytes as they arrive (file ranges copied by the
kernel, or a tensor's memory), so no shard is ever held in memory; each shard is on disk when it is
closed. `write_index` writes `model.safetensors.index.json` (the completion sentinel, written last by
the converter, fsynced).

What it is not: a general safetensors library: tensors must arrive in the planned order.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from miles.ckpt.convert import bytecopy
from miles.ckpt.convert.families import ModelShape
from miles.ckpt.convert.layout import hf_shapes
from miles.ckpt.convert.torch_format import BY_SAFETENSORS, DTYPES, dtype_of, numel, safetensors_header
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

_ST_DTYPES = {d.name: d.safetensors for d in DTYPES.values()}


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
    """Where each tensor of a HF checkpoint lies, validated against the config's implied shapes."""

    def __init__(self, directory: Path, shape: ModelShape):
        self.directory, self.shape = directory, shape
        self._headers: dict[str, tuple[dict[str, dict], int, int]] = {}  # header, data start, file size
        self.weight_map = self._weight_map()

    def _weight_map(self) -> dict[str, str]:
        index = self.directory / INDEX
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (OSError, json.JSONDecodeError, KeyError) as e:
                raise UserError(f"{index} is not a valid safetensors index ({e}); re-download the checkpoint.") from None
        elif (self.directory / SINGLE).is_file():
            weight_map = {k: SINGLE for k in self._header(SINGLE)[0]}
        else:
            raise UserError(f"{self.directory} has neither {SINGLE} nor {INDEX}; pass a directory with safetensors weights.")
        missing_files = sorted({f for f in weight_map.values() if not (self.directory / f).is_file()})
        if missing_files:
            raise UserError(f"{self.directory} is incomplete: {INDEX} lists missing shard files {_short(missing_files)}; finish the download.")
        return weight_map

    def _header(self, file: str) -> tuple[dict[str, dict], int]:
        if file not in self._headers:
            path = self.directory / file
            try:
                header, data_start = safetensors_header(path)
            except (OSError, ValueError) as e:  # JSONDecodeError is a ValueError
                raise UserError(f"{path} is not a readable safetensors file ({e}); re-download the checkpoint.") from None
            self._headers[file] = (header, data_start, path.stat().st_size)
        return self._headers[file][:2]

    def __enter__(self) -> HFReader:
        self.validate()
        return self

    def __exit__(self, *exc: object) -> None:
        self._headers.clear()

    def _entry(self, name: str) -> dict:
        return self._header(self.weight_map[name])[0][name]

    def validate(self) -> None:
        expected = hf_shapes(self.shape)
        missing = [n for n in expected if n not in self.weight_map]
        problems = [f"missing tensors {_short(missing)}"] if missing else []
        for name, want in expected.items():
            if name not in self.weight_map:
                continue
            entry = self._header(self.weight_map[name])[0].get(name)
            if entry is None:
                problems.append(f"{name} is listed in {INDEX} but not in {self.weight_map[name]}")
                continue
            got = tuple(entry["shape"])
            if got != want:
                problems.append(f"{name} has shape {list(got)}, config implies {list(want)}")
                continue
            dt = BY_SAFETENSORS.get(entry["dtype"])
            if dt is None:
                problems.append(f"{name} has dtype {entry['dtype']}, which miles convert does not handle")
                continue
            begin, end = entry["data_offsets"]
            _, start, size = self._headers[self.weight_map[name]]
            if end - begin != numel(got) * dt.itemsize or start + end > size:
                problems.append(f"{name}'s bytes [{begin}, {end}) do not fit its shape or its file")
        if problems:
            raise UserError(f"{self.directory} does not match its config.json ({self.shape.architecture}): "
                            f"{_short(problems, 8)}; the checkpoint is partial or the config is wrong.")

    def source(self, name: str) -> bytecopy.Source:
        """Where tensor `name`'s bytes lie (one range of its shard); nothing is read."""
        file = self.weight_map[name]
        header, start = self._header(file)
        entry = header[name]
        begin, end = entry["data_offsets"]
        seg = bytecopy.Segment(self.directory / file, start + begin, end - begin)
        return bytecopy.Source(self.dtype(name), tuple(entry["shape"]), (seg,))

    def get(self, name: str) -> torch.Tensor:
        """The tensor itself, through safetensors and torch (the benchmark's baseline; not the converter)."""
        from safetensors import safe_open

        with safe_open(self.directory / self.weight_map[name], framework="pt") as f:
            return f.get_tensor(name)

    def dtype(self, name: str) -> str:
        """The stored dtype's name ("bfloat16"), from the safetensors header (no data is read)."""
        return BY_SAFETENSORS[self._entry(name)["dtype"]].name

    def nbytes(self, name: str) -> int:
        return numel(self._entry(name)["shape"]) * DTYPES[self.dtype(name)].itemsize


@dataclass
class _Shard:
    file: str
    names: list[str]
    header: dict
    size: int


class ShardedSafetensorsWriter:
    """Writes planned tensors into `model-XXXXX-of-YYYYY.safetensors` shards of at most `chunk_size` bytes."""

    def __init__(self, directory: Path, plan: list[tuple[str, tuple[int, ...], Any]], chunk_size: int):
        self.directory = directory
        groups: list[list[tuple[str, tuple[int, ...], str, int]]] = [[]]
        size = 0
        for name, shp, dtype in plan:
            dtype = dtype_of(dtype).name
            n = numel(shp) * DTYPES[dtype].itemsize
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
                header[name] = {"dtype": _ST_DTYPES[dtype], "shape": list(shp),
                                "data_offsets": [offset, offset + n]}
                offset += n
            file = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
            self.shards.append(_Shard(file, [x[0] for x in g], header, offset))
        self._order = [(s, n) for s in self.shards for n in s.names]
        self._pos = 0
        self._fh = None

    def write(self, name: str, data: Any) -> None:
        """Append tensor `name`: a `bytecopy.Source` (copied by the kernel) or a torch tensor."""
        shard, expected = self._order[self._pos]
        if name != expected:
            raise RuntimeError(f"tensor {name} arrived out of the planned order (expected {expected})")
        meta = shard.header[name]
        if list(data.shape) != meta["shape"] or _ST_DTYPES[dtype_of(data.dtype).name] != meta["dtype"]:
            raise RuntimeError(f"{name}: got {tuple(data.shape)} {data.dtype}, planned {meta['shape']} {meta['dtype']}")
        if shard.names[0] == name:
            self._open(shard)
        if isinstance(data, bytecopy.Source):
            for seg in data.segments:
                self._fh.copy(seg)
        else:
            import torch  # a tensor exists, so torch is already imported

            self._fh.write(data.detach().contiguous().reshape(-1).view(torch.uint8).numpy())
        self._pos += 1
        if shard.names[-1] == name:
            self._fh.close()  # fsyncs: the index written last points at these bytes
            self._fh = None

    def _open(self, shard: _Shard) -> None:
        header = json.dumps(shard.header, separators=(",", ":")).encode()
        header += b" " * (-len(header) % 8)  # the data section starts 8-byte aligned
        self._fh = bytecopy.OutputFile(self.directory / shard.file)
        self._fh.write(struct.pack("<Q", len(header)) + header)

    def abort(self) -> None:
        if self._fh is not None:
            self._fh.close(sync=False)
            self._fh = None

    def write_index(self) -> None:
        if self._pos != len(self._order):
            raise RuntimeError(f"only {self._pos} of {len(self._order)} planned tensors were written")
        weight_map = {n: s.file for s in self.shards for n in s.names}
        index = {"metadata": {"total_size": sum(s.size for s in self.shards)}, "weight_map": weight_map}
        bytecopy.write_durably(self.directory / INDEX, (json.dumps(index, indent=2) + "\n").encode())
        bytecopy.fsync_dir(self.directory)
