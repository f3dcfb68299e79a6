"""The streaming torch_dist writer: same checkpoint as megatron-core writes, one tensor alive at a time.

`save_torch_dist` does not call megatron-core's `dist_checkpointing.save`; these tests use that call as
the oracle: for the same tensors both must produce the same `.metadata` index (keys, global shapes,
chunks, dtypes, the `_extra_state` objects) and the same bytes, and megatron-core's
`dist_checkpointing.load` must read ours back bit-exact, also when it is split over several files.

`miles convert` moves bytes, not tensors (QKV and gate/up fused as row-block byte ranges): its output
is checked against the torch mapping (`fuse_qkv`, `torch.cat`) read back through `torch.load`, and
the reverse direction against megatron-core's own save of the mapped tensors; neither direction may
import torch at all, and every output file is fsynced before the file that says "complete".
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import warnings
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch.distributed.checkpoint import FileSystemReader
from torch.multiprocessing.reductions import StorageWeakRef

from _mp_megatron import free_port
from _mp_models import make_hf_model
from miles.ckpt.convert import ModelShape, hf_to_megatron_state_dict, run_convert
from miles.ckpt.convert.layout import extra_state_keys, megatron_shapes, sharded_key
from miles.ckpt.convert.mapping import rules_for
from miles.ckpt.convert.torch_dist import PlannedTensor, TorchDistReader, save_torch_dist
from miles.config.convert import ConvertOptions

torch.set_num_threads(1)
warnings.filterwarnings("ignore")


def _model(tmp_path, family):
    make_hf_model(family, tmp_path / "hf")
    shape = ModelShape.from_hf_config(json.loads((tmp_path / "hf" / "config.json").read_text()))
    return shape, hf_to_megatron_state_dict(load_file(tmp_path / "hf" / "model.safetensors"), shape)


def _plan(mg: dict[str, torch.Tensor]) -> list[PlannedTensor]:
    return [PlannedTensor(n, tuple(t.shape), t.dtype) for n, t in mg.items()]


@contextlib.contextmanager
def _one_rank():
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1,
                            timeout=timedelta(seconds=60))
    try:
        yield
    finally:
        dist.destroy_process_group()


def _megatron_sharded(tensors: dict[str, torch.Tensor], shape: ModelShape) -> dict:
    """The sharded state dict a local-spec GPTModel would hand to dist_checkpointing (data = `tensors`)."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

    out: dict = {}
    for name, t in tensors.items():
        sk = sharded_key(name, shape)
        out[name] = ShardedTensor.from_rank_offsets(sk.key, t, *sk.prepend, replica_id=0, prepend_axis_num=len(sk.prepend))
    for sk in extra_state_keys(rules_for(shape), shape):
        offset = tuple(p[1] for p in sk.prepend)
        out[f"{sk.key}/{offset}"] = ShardedObject(sk.key, None, tuple(p[2] for p in sk.prepend), offset, replica_id=0)
    return out


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe"])  # dense (layer axis) and MoE (layer x expert axes)
def test_metadata_and_bytes_equal_megatron_core_save(tmp_path, family):
    from megatron.core import dist_checkpointing

    from miles.ckpt.megatron_compat import cpu_compat

    shape, mg = _model(tmp_path, family)
    save_torch_dist(_plan(mg), lambda n: mg[n], tmp_path / "ours", shape)
    (tmp_path / "theirs").mkdir()
    with cpu_compat(), _one_rank():
        dist_checkpointing.save(_megatron_sharded(mg, shape), str(tmp_path / "theirs"), sharded_strategy=("torch_dist", 1))

    ours = FileSystemReader(str(tmp_path / "ours")).read_metadata()
    theirs = FileSystemReader(str(tmp_path / "theirs")).read_metadata()
    assert ours.state_dict_metadata == theirs.state_dict_metadata
    assert set(ours.storage_data) == set(theirs.storage_data)
    for f in ("metadata.json", "common.pt"):
        assert (tmp_path / "ours" / f).read_bytes() == (tmp_path / "theirs" / f).read_bytes(), f
    with TorchDistReader(tmp_path / "ours", shape) as a, TorchDistReader(tmp_path / "theirs", shape) as b:
        for name, t in mg.items():
            x, y = a.read([name])[name], b.read([name])[name]
            assert torch.equal(x, t) and torch.equal(y, t), name


def test_megatron_core_loads_a_multi_file_streamed_checkpoint_bit_exact(tmp_path):
    from megatron.core import dist_checkpointing

    shape, mg = _model(tmp_path, "qwen3_moe")
    save_torch_dist(_plan(mg), lambda n: mg[n], tmp_path / "ours", shape, file_bytes=4096)
    files = sorted(p.name for p in (tmp_path / "ours").glob("*.distcp"))
    assert len(files) > 5 and files[0] == "__0_0.distcp"
    empty = {n: torch.full_like(t, float("nan")) for n, t in mg.items()}
    with _one_rank():
        loaded = dist_checkpointing.load(_megatron_sharded(empty, shape), str(tmp_path / "ours"))
    for name, t in mg.items():
        assert torch.equal(loaded[name], t), name


def test_writer_holds_one_produced_tensor_at_a_time(tmp_path):
    # torch's stock FileSystemWriter keeps every tensor of a file alive until the file is closed; ours
    # must have let go of each tensor before it asks for the next one.
    shape, mg = _model(tmp_path, "qwen3")
    alive: list[tuple[str, StorageWeakRef]] = []
    overlaps: list[tuple[str, list[str]]] = []

    def produce(name: str) -> torch.Tensor:
        still = [n for n, ref in alive if not ref.expired()]
        if still:
            overlaps.append((name, still))
        t = mg[name].clone()  # a fresh storage, owned only by the writer once returned
        alive.append((name, StorageWeakRef(t.untyped_storage())))
        return t

    save_torch_dist(_plan(mg), produce, tmp_path / "ours", shape, file_bytes=1)
    assert [n for n, _ in alive] == list(mg)  # each tensor produced once, in plan order
    assert overlaps == []
    assert all(ref.expired() for _, ref in alive)


def test_a_tensor_unlike_its_plan_is_an_internal_error(tmp_path):
    shape, mg = _model(tmp_path, "llama")
    with pytest.raises(RuntimeError, match="embedding.word_embeddings.weight: produced .* planned"):
        save_torch_dist(_plan(mg), lambda n: mg[n].to(torch.float16), tmp_path / "ours", shape)
    assert not (tmp_path / "ours" / "metadata.json").exists()


def test_plan_shapes_are_the_config_shapes(tmp_path):
    shape, mg = _model(tmp_path, "qwen2")
    assert {n: tuple(t.shape) for n, t in mg.items()} == megatron_shapes(shape)


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "llama", "qwen3_moe"])
def test_converted_tensors_equal_the_torch_mapping_bit_exact(tmp_path, family):
    # The converter copies byte ranges; torch's fuse_qkv / cat (mapping.py) is the reference, and
    # torch.load (TorchDistReader.read) reads the records, not our record parser.
    shape, mg = _model(tmp_path, family)
    run_convert(ConvertOptions(hf_checkpoint=str(tmp_path / "hf"), save=str(tmp_path / "td")), progress=False)
    with TorchDistReader(tmp_path / "td" / "release", shape) as reader:
        for name, t in mg.items():
            assert torch.equal(reader.read([name])[name], t), name


@pytest.mark.parametrize("split", ["rows", "columns", "uneven"])
def test_reader_finds_the_bytes_of_tensors_stored_in_several_chunks(tmp_path, split):
    # A TP>1 training save stores a tensor as chunks: column-parallel weights split along their rows,
    # row-parallel ones along their columns. The byte ranges `source` finds, read back, must equal
    # what torch assembles from the same chunks (`read`), and `miles convert` must give the HF tensors.
    import json as _json

    from miles.ckpt.convert import bytecopy, dcp_stream
    from miles.ckpt.convert.torch_dist import CONFIG, MEGATRON_CONFIG

    shape, mg = _model(tmp_path, "qwen3")
    items, pieces = [], {}
    for name, t in mg.items():
        sk = sharded_key(name, shape)
        dim = 1 if split == "columns" and t.dim() == 2 else 0
        cuts = [0, t.shape[dim] // 2, t.shape[dim]] if split != "uneven" else [0, 1, t.shape[dim] // 3, t.shape[dim]]
        for i, (x, y) in enumerate(zip(cuts, cuts[1:])):
            piece = t.narrow(dim, x, y - x).contiguous()
            offsets = [0] * t.dim()
            offsets[dim] = x
            pieces[f"{name}#{i}"] = piece
            items.append(dcp_stream.Item(sk.key, tuple([p[1] for p in sk.prepend] + offsets),
                                         tuple([p[2] for p in sk.prepend] + list(t.shape)), f"{name}#{i}",
                                         tuple(piece.shape), piece.dtype))
    ckpt = tmp_path / "tp"
    ckpt.mkdir()
    dcp_stream.save(items, pieces.__getitem__, ckpt, file_bytes=30_000)
    (ckpt / CONFIG).write_text(_json.dumps(MEGATRON_CONFIG))
    with TorchDistReader(ckpt, shape) as reader:
        for name, t in mg.items():
            src = reader.source(name)
            assert src is not None and src.shape == tuple(t.shape), name
            raw = b"".join(bytecopy.read_segment(seg) for seg in src.segments)
            assert torch.equal(torch.frombuffer(bytearray(raw), dtype=t.dtype).reshape(t.shape), reader.read([name])[name]), name
            assert torch.equal(reader.read([name])[name], t), name
    bytecopy.SOURCES.close()
    run_convert(ConvertOptions(from_format="torch_dist", to_format="hf", load=str(ckpt), origin_hf_dir=str(tmp_path / "hf"),
                               save=str(tmp_path / "back")), progress=False)
    orig, back = load_file(tmp_path / "hf" / "model.safetensors"), load_file(tmp_path / "back" / "model-00001-of-00001.safetensors")
    assert set(orig) == set(back) and all(torch.equal(back[n], t) for n, t in orig.items())


def test_records_the_stand_in_writer_refuses_go_through_torch_save(tmp_path, monkeypatch):
    # Tensors of 4 GiB or more (zip64), float8 and empty tensors are written by torch.save itself,
    # from the same byte ranges; forced here for every tensor.
    from miles.ckpt.convert import dcp_stream
    from miles.ckpt.convert.torch_format import NeedsTorch

    def refuse(dtype, shape):
        raise NeedsTorch("forced by the test")

    monkeypatch.setattr(dcp_stream, "tensor_record", refuse)
    shape, mg = _model(tmp_path, "qwen3")
    run_convert(ConvertOptions(hf_checkpoint=str(tmp_path / "hf"), save=str(tmp_path / "td")), progress=False)
    with TorchDistReader(tmp_path / "td" / "release", shape) as reader:
        for name, t in mg.items():
            assert torch.equal(reader.read([name])[name], t), name


@pytest.mark.parametrize("family", ["qwen2", "qwen3_moe"])
def test_megatron_core_saves_convert_to_hf_bit_exact(tmp_path, family):
    # The reverse direction from a checkpoint megatron-core itself wrote (torch's records, CRC-32 on).
    from megatron.core import dist_checkpointing

    from miles.ckpt.megatron_compat import cpu_compat

    shape, mg = _model(tmp_path, family)
    (tmp_path / "theirs").mkdir()
    with cpu_compat(), _one_rank():
        dist_checkpointing.save(_megatron_sharded(mg, shape), str(tmp_path / "theirs"), sharded_strategy=("torch_dist", 1))
    run_convert(ConvertOptions(from_format="torch_dist", to_format="hf", load=str(tmp_path / "theirs"),
                               origin_hf_dir=str(tmp_path / "hf"), save=str(tmp_path / "back")), progress=False)
    orig, back = load_file(tmp_path / "hf" / "model.safetensors"), load_file(tmp_path / "back" / "model-00001-of-00001.safetensors")
    assert set(orig) == set(back)
    for name, t in orig.items():
        assert torch.equal(back[name], t), name


def test_every_file_is_on_disk_before_the_tracker_or_index(tmp_path, monkeypatch):
    make_hf_model("qwen3", tmp_path / "hf")
    events: list[tuple[str, str]] = []
    real_open, real_fsync = os.open, os.fsync

    def logged_open(path, flags, *a):
        if flags & os.O_CREAT:
            events.append(("create", Path(path).name))
        return real_open(path, flags, *a)

    def logged_fsync(fd):
        events.append(("fsync", Path(os.readlink(f"/proc/self/fd/{fd}")).name))
        return real_fsync(fd)

    monkeypatch.setattr(os, "open", logged_open)
    monkeypatch.setattr(os, "fsync", logged_fsync)
    run_convert(ConvertOptions(hf_checkpoint=str(tmp_path / "hf"), save=str(tmp_path / "td")), progress=False)
    tracker = events.index(("create", "latest_checkpointed_iteration.txt"))
    # .metadata is fsynced as .metadata.tmp, then renamed (the fsync of release/ makes the rename durable).
    synced = {name.removesuffix(".tmp") for kind, name in events[:tracker] if kind == "fsync"}
    written = {p.name for p in (tmp_path / "td").rglob("*") if p.is_file()} - {"latest_checkpointed_iteration.txt"}
    assert {"__0_0.distcp", ".metadata", "common.pt", "metadata.json", "config.json"} <= written
    assert written <= synced and {"release", "hf_assets"} <= synced, written - synced
    assert ("fsync", "latest_checkpointed_iteration.txt") in events[tracker:]
    assert events[-1][0] == "fsync"  # the parent directory, after the rename

    events.clear()
    run_convert(ConvertOptions(from_format="torch_dist", to_format="hf", load=str(tmp_path / "td"), save=str(tmp_path / "back"),
                               chunk_size=20_000), progress=False)
    index = events.index(("create", "model.safetensors.index.json"))
    synced = {name for kind, name in events[:index] if kind == "fsync"}
    shards = {p.name for p in (tmp_path / "back").glob("*.safetensors")}
    assert len(shards) > 1 and shards <= synced


def test_converting_does_not_import_torch_or_megatron_core(tmp_path):
    # At the sizes people convert on one machine, `import torch` (1.5-2 s) costs more than copying the
    # bytes (a 1 GB checkpoint: 0.3 s); megatron-core adds 4 s, torch.distributed.checkpoint 1.5-2.5 s.
    make_hf_model("qwen3", tmp_path / "hf")
    code = (
        "import sys\n"
        "from miles.ckpt.convert import run_convert\n"
        "from miles.config.convert import ConvertOptions\n"
        f"run_convert(ConvertOptions(hf_checkpoint='{tmp_path}/hf', save='{tmp_path}/td'), progress=False)\n"
        f"run_convert(ConvertOptions(from_format='torch_dist', to_format='hf', load='{tmp_path}/td', save='{tmp_path}/back'), progress=False)\n"
        "print(sorted({m.split('.')[0] for m in sys.modules if m.startswith(('megatron', 'torch', 'safetensors', 'numpy', 'sympy'))}))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    assert r.returncode == 0, r.stderr
    assert r.stdout.split("\n")[-2] == "[]"
    assert (tmp_path / "back" / "model.safetensors.index.json").is_file()


def test_the_miles_convert_command_does_not_import_torch(tmp_path):
    # The program as users run it: `python -X importtime` lists every module the command imported.
    make_hf_model("llama", tmp_path / "hf")
    r = subprocess.run([sys.executable, "-X", "importtime", "-m", "miles_cli.main", "convert", "--hf-checkpoint", "hf", "--save", "td"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "td" / "latest_checkpointed_iteration.txt").read_text() == "release"
    imported = [line.rsplit("|", 1)[-1].strip() for line in r.stderr.splitlines() if line.startswith("import time:")]
    assert "miles.ckpt.convert.run" in imported
    assert [m for m in imported if m.split(".")[0] in ("torch", "safetensors", "numpy", "megatron")] == []
