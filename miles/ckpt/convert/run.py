"""`run_convert`: the whole conversion, atomic and resumable-by-skip, with a rich progress bar.

HF -> torch_dist: plan every megatron tensor (name, shape, dtype) from the config and the safetensors
headers, then write `<tmp>/release/` (torch_dist.py): each megatron tensor is its HF parts' byte
ranges in the order mapping.row_blocks gives (QKV interleaved per query group, gate ‖ up), copied by
the kernel (bytecopy.py) into a `torch.save` record (torch_format.py); copy config/tokenizer files
into `<tmp>/hf_assets/` (the default origin for the reverse conversion), write
`latest_checkpointed_iteration.txt` = `release` LAST, then rename `<tmp>` to `--save`.

torch_dist -> HF: each HF tensor is a set of row blocks of one stored megatron tensor
(mapping.split_blocks), itself byte ranges of its stored chunks whatever TP layout wrote them
(TorchDistReader.source), copied the same way into planned safetensors shards; only a record that
is not a plain `torch.save`d tensor is read with torch. Copy config/tokenizer files, write
`model.safetensors.index.json` LAST, rename.

Neither direction imports torch for a checkpoint we wrote (tests/ckpt/test_convert_streaming.py), and
no tensor passes through this process's memory. Durable: every file is fsynced before the file that
says "complete" (tracker or index) is written, and the directories are fsynced around the rename.

An interrupted run leaves only a hidden `.<name>.tmp-<host>-<pid>` directory, never something that
looks complete; the next conversion to the same output on that host removes it. `prepare_torch_dist` is the sentinel-guarded step `miles full-train` calls.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import shutil
import socket
import sys
from pathlib import Path
from typing import Any

from miles.ckpt.convert import bytecopy
from miles.ckpt.convert.families import ModelShape, validate_megatron_args
from miles.ckpt.convert.hf_io import HF_ASSET_FILES, INDEX, HFReader, ShardedSafetensorsWriter, read_hf_config
from miles.ckpt.convert import trainer_dcp
from miles.ckpt.convert.layout import hf_shapes, megatron_shapes
from miles.ckpt.convert.locate import ASSETS_DIR, find_origin, locate_checkpoint
from miles.ckpt.convert.torch_format import numel
from miles.ckpt.convert.mapping import megatron_to_hf, row_blocks, rules_for, split_blocks
from miles.ckpt.convert.torch_dist import TRACKER, PlannedTensor, TorchDistReader, save_torch_dist
from miles.config.convert import ConvertOptions
from miles.errors import UserError

RECORD = "miles_convert.json"


def is_complete(out: Path, to_format: str) -> bool:
    """The sentinel upstream uses: tracker reading `release` (torch_dist), or the index file (hf)."""
    if to_format == "torch_dist":
        tracker = out / TRACKER
        return tracker.is_file() and tracker.read_text().strip() == "release"
    return (out / INDEX).is_file()


def run_convert(opts: ConvertOptions, *, progress: bool = True) -> Path:
    """Convert per `opts`; returns the output directory (skips a complete one unless --force)."""
    opts.check()
    out = Path(opts.save).absolute()
    if is_complete(out, opts.to_format) and not opts.force:
        _print(f"skipped: {out} is already complete (use --force to convert again)")
        return out
    if out.exists() and not opts.force:
        raise UserError(f"--save {out} exists but is not a complete {opts.to_format} checkpoint; pass --force to replace it or choose another directory.", option="--save")
    out.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_tmp(out)
    tmp = out.parent / f"{_tmp_prefix(out)}{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        if opts.from_format == "hf":
            _hf_to_torch_dist(Path(opts.hf_checkpoint), tmp, opts, progress)
        else:
            _torch_dist_to_hf(Path(opts.load), tmp, opts, progress)
        bytecopy.fsync_dir(tmp)
        _replace(tmp, out)
        bytecopy.fsync_dir(out.parent)  # the rename itself
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        bytecopy.SOURCES.close()
    _print(f"wrote {out}")
    return out


def prepare_torch_dist(hf_checkpoint: str | Path, save: str | Path, *, expected_megatron_args: dict[str, Any] | None = None,
                       tensor_model_parallel_size: int = 1, force: bool = False, progress: bool = True) -> Path:
    """The `miles full-train` convert step: skipped when `save` already holds a complete conversion.

    `expected_megatron_args` (megatron flag names in snake_case, e.g. a recipe's model args) are checked
    against the HF config first, all mismatches reported in one `UserError`.
    """
    if expected_megatron_args:
        shape = ModelShape.from_hf_config(read_hf_config(Path(hf_checkpoint)), source=f"{hf_checkpoint}/config.json")
        validate_megatron_args(shape, expected_megatron_args, tensor_model_parallel_size=tensor_model_parallel_size)
    opts = ConvertOptions(from_format="hf", to_format="torch_dist", hf_checkpoint=str(hf_checkpoint), save=str(save),
                          force=force, tensor_model_parallel_size=tensor_model_parallel_size)
    return run_convert(opts, progress=progress)


def _tmp_prefix(out: Path) -> str:
    # The host is in the name so that a run on another node sharing the file system is never
    # mistaken for a dead one here.
    return f".{out.name}.tmp-{socket.gethostname()}-"


def _remove_stale_tmp(out: Path) -> None:
    """Delete temporary directories left by killed conversions of `out` on this host."""
    prefix = _tmp_prefix(out)
    for stale in out.parent.glob(glob.escape(prefix) + "*"):
        pid = stale.name[len(prefix):]
        if pid.isdigit() and not _pid_alive(int(pid)):
            shutil.rmtree(stale, ignore_errors=True)
            _print(f"removed {stale.name}, left by an interrupted conversion (process {pid} is gone)")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def _replace(tmp: Path, out: Path) -> None:
    old = None
    if out.exists():
        old = out.parent / f".{out.name}.old-{os.getpid()}"
        out.rename(old)
    tmp.rename(out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _copy_assets(src: Path, dst: Path) -> None:
    dst.mkdir(parents=True, exist_ok=True)
    for name in HF_ASSET_FILES:
        if (src / name).is_file():
            out = bytecopy.OutputFile(dst / name)
            try:
                out.copy(bytecopy.Segment(src / name, 0, (src / name).stat().st_size))
            finally:
                out.close()
            shutil.copystat(src / name, dst / name)
    bytecopy.fsync_dir(dst)


def _shape(directory: Path, opts: ConvertOptions) -> ModelShape:
    shape = ModelShape.from_hf_config(read_hf_config(directory), source=f"{directory}/config.json")
    validate_megatron_args(shape, {}, tensor_model_parallel_size=opts.tensor_model_parallel_size)
    return shape


def _hf_to_torch_dist(src: Path, tmp: Path, opts: ConvertOptions, progress: bool) -> None:
    shape = _shape(src, opts)
    rules = {r.megatron: r for r in rules_for(shape)}
    with HFReader(src, shape) as reader:
        plan = []
        for name, local_shape in megatron_shapes(shape).items():
            dtypes = {reader.dtype(n) for n in rules[name].hf}
            if len(dtypes) != 1:
                raise UserError(f"{src}: {', '.join(rules[name].hf)} have different dtypes {sorted(dtypes)}; "
                                "they are fused into one megatron tensor, so convert them to one dtype first.")
            plan.append(PlannedTensor(name, local_shape, dtypes.pop()))
        total = sum(reader.nbytes(n) for r in rules.values() for n in r.hf)
        with _progress(progress, f"{src.name} -> torch_dist", len(plan), total) as advance:
            def produce(name: str) -> bytecopy.Source:
                rule = rules[name]
                parts = [reader.source(n) for n in rule.hf]
                fused = bytecopy.gather_rows(parts, row_blocks(rule, shape, [p.shape[0] for p in parts]))
                advance(1, fused.nbytes)
                return fused

            save_torch_dist(plan, produce, tmp / "release", shape)
    _copy_assets(src, tmp / ASSETS_DIR)
    record = {"from": "hf", "hf_checkpoint": str(src.absolute()), "architecture": shape.architecture}
    bytecopy.write_durably(tmp / RECORD, (json.dumps(record, indent=2) + "\n").encode())
    bytecopy.write_durably(tmp / TRACKER, b"release")  # last: its presence is what "complete" means


def _torch_dist_to_hf(load: Path, tmp: Path, opts: ConvertOptions, progress: bool) -> None:
    located = locate_checkpoint(load, opts.ckpt_step)
    origin = find_origin(load, located, opts.origin_hf_dir)
    if not (origin / "config.json").is_file():
        raise UserError(f"--origin-hf-dir {origin} has no config.json; pass the Hugging Face model the checkpoint came from.", option="--origin-hf-dir")
    if located.kind == "torch":
        planned = trainer_dcp.plan(located.directory, read_hf_config(origin))
        total = sum(numel(shp) * dtype.itemsize for _, shp, dtype in planned)
        with _progress(progress, f"{located.directory.name} -> {Path(opts.save).name}", len(planned), total) as advance:
            trainer_dcp.write_hf_weights(located.directory, tmp, planned, opts.chunk_size, advance)
        _copy_assets(origin, tmp)
        return
    ckpt = located.directory
    shape = _shape(origin, opts)
    rules = rules_for(shape)
    with TorchDistReader(ckpt, shape) as reader:
        dtype = reader.stored_dtype()
        hf_shape_of = hf_shapes(shape)
        plan = [(n, hf_shape_of[n], dtype) for r in rules for n in r.hf]
        writer = ShardedSafetensorsWriter(tmp, plan, opts.chunk_size)
        total = sum(s.size for s in writer.shards)
        try:
            with _progress(progress, f"torch_dist -> {Path(opts.save).name}", len(rules), total) as advance:
                for r in rules:
                    whole = reader.source(r.megatron)
                    if whole is None:
                        # A record that is not a plain torch.save'd tensor: read with torch.
                        parts = megatron_to_hf(r, reader.read([r.megatron])[r.megatron], shape)
                    else:
                        blocks = split_blocks(r, shape, [hf_shape_of[n][0] for n in r.hf])
                        parts = [bytecopy.take_rows(whole, b) for b in blocks]
                    for name, part in zip(r.hf, parts):
                        writer.write(name, part)
                    advance(1, sum(p.nbytes for p in parts))
        except BaseException:
            writer.abort()
            raise
    _copy_assets(origin, tmp)
    writer.write_index()  # last: the completion sentinel of an HF export


@contextlib.contextmanager
def _progress(enabled: bool, title: str, n_tensors: int, n_bytes: int):
    """Yields advance(tensors, bytes); a rich bar with tensors done/total and bytes when enabled."""
    if not enabled:
        yield lambda _t, _b: None
        return
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

    columns = (TextColumn("{task.description}"), BarColumn(), TextColumn("{task.fields[done]}/{task.fields[of]} tensors"),
               DownloadColumn(), TransferSpeedColumn(), TimeRemainingColumn())
    with Progress(*columns, transient=False) as bar:
        task = bar.add_task(title, total=n_bytes, done=0, of=n_tensors)
        count = 0

        def advance(tensors: int, nbytes: int) -> None:
            nonlocal count
            count += tensors
            bar.update(task, advance=nbytes, done=count)

        yield advance


def _print(message: str) -> None:
    # Plain text: a path is not rich markup ("[...]" in a directory name would be eaten).
    print(message, file=sys.stderr, flush=True)
