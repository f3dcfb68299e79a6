"""torch_format.py writes what torch writes, byte for byte, without importing torch.

The converter writes `torch.save` records and DCP `.metadata` pickles itself; these tests hold them to
torch 2.13's own output (records with CRC-32 off, as the converter always saved; small objects with it
on, as megatron-core writes them) and check that the reader finds a tensor's bytes in torch's records.
"""

from __future__ import annotations

import io
import pickle

import pytest
import torch
from torch.utils.serialization import config

from miles.ckpt.convert import dcp_stream
from miles.ckpt.convert import torch_format as tf


def _torch_save(obj, crc: bool) -> bytes:
    buf = io.BytesIO()
    with config.patch({"save.compute_crc32": crc}):
        torch.save(obj, buf)
    return buf.getvalue()


def _raw(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


SHAPES = [(), (3,), (2, 3), (1, 2, 300), (70_000,), (4, 1, 2, 3, 5), (1, 300, 70_000 // 300)]


@pytest.mark.parametrize("dtype", [d for d, v in tf.DTYPES.items() if v.storage])
def test_tensor_record_is_torch_save_byte_for_byte(dtype):
    # Sizes cross pickle's 1-, 2- and 4-byte integer opcodes and 1-, 2-, 3- and n-tuples.
    for shape in SHAPES:
        t = (torch.rand(shape) * 100).to(getattr(torch, dtype))
        head, tail = tf.tensor_record(dtype, shape)
        assert head + _raw(t) + tail == _torch_save(t, crc=False), (dtype, shape)


def test_dtype_table_matches_torch():
    for name, d in tf.DTYPES.items():
        assert torch.empty((), dtype=getattr(torch, name)).element_size() == d.itemsize, name
        assert tf.dtype_of(getattr(torch, name)) is d and tf.dtype_of(name) is d


def test_records_torch_does_not_lay_out_the_same_way_are_refused():
    with pytest.raises(tf.NeedsTorch):
        tf.tensor_record("float32", (0, 4))
    with pytest.raises(tf.NeedsTorch):
        tf.tensor_record("float8_e4m3fn", (4,))
    with pytest.raises(tf.NeedsTorch):
        tf.tensor_record("uint8", (2**32,))  # zip64 sizes


def test_object_records_are_torch_save_byte_for_byte(tmp_path):
    for obj in ([None], {}):
        assert tf.object_record(obj) == _torch_save(obj, crc=True)
    torch.save({}, tmp_path / "common.pt")  # saved to a path: entries under the file's stem
    assert tf.object_record({}, archive="common") == (tmp_path / "common.pt").read_bytes()


@pytest.mark.parametrize("crc", [False, True])
def test_reader_finds_the_tensor_bytes_in_torch_records(crc):
    base = torch.arange(60, dtype=torch.float32).reshape(6, 10)
    for t in (base, base[2:], base.to(torch.bfloat16), torch.tensor(3.5)):
        rec = _torch_save(t, crc)
        pad = b"\xee" * 123  # the record sits inside a larger file
        loc = tf.read_tensor_record(io.BytesIO(pad + rec + pad), len(pad), len(rec))
        assert (loc.dtype.name, loc.shape) == (str(t.dtype).removeprefix("torch."), tuple(t.shape))
        assert (pad + rec)[loc.offset:loc.offset + loc.nbytes] == _raw(t)
    with pytest.raises(tf.NotPlain):
        rec = _torch_save(base.t(), crc)  # column-major: not a byte range
        tf.read_tensor_record(io.BytesIO(rec), 0, len(rec))


def test_reader_resolves_no_other_globals():
    rec = _torch_save(torch.zeros(2), crc=False).replace(b"archive/data.pkl", b"archive/data.pkX")
    with pytest.raises(tf.NotPlain):
        tf.read_tensor_record(io.BytesIO(rec), 0, len(rec))  # no data.pkl at all
    ar = tf._Archive(crc=False)
    ar.add("data.pkl", pickle.dumps(print, protocol=2))  # a header naming builtins.print
    rec = b"".join(ar.finish(0))
    with pytest.raises(pickle.UnpicklingError, match="unexpected global .*print"):
        tf.read_tensor_record(io.BytesIO(rec), 0, len(rec))


def test_metadata_pickle_equals_the_pickle_of_torch_objects():
    # The stand-ins (Size, dtype names, the strided layout) must pickle exactly as torch's own objects do.
    def meta(size, dtype):
        index = dcp_stream.MetadataIndex("a", None, 0)
        index.offset = size((0, 0))
        return dcp_stream.Metadata(
            {"a": dcp_stream.TensorStorageMetadata(dcp_stream.TensorProperties(dtype), size((2, 3)),
                                                   [dcp_stream.ChunkStorageMetadata(size((0, 0)), size((2, 3)))]),
             "b": dcp_stream.BytesStorageMetadata()},
            storage_data={index: dcp_stream._StorageInfo("__0_0.distcp", 0, 9)},
            version="1.0.0", storage_meta=dcp_stream.StorageMeta(checkpoint_id="/x", save_id="id"))

    def dump(m):
        buf = io.BytesIO()
        tf.Pickler(buf, protocol=pickle.DEFAULT_PROTOCOL, globals_map=dcp_stream._GLOBALS).dump(m)
        return buf.getvalue()

    ours = dump(meta(tf.Size, tf.torch_dtype("bfloat16")))
    assert ours == dump(meta(torch.Size, torch.bfloat16))
    from torch.distributed.checkpoint.metadata import Metadata

    theirs = pickle.loads(ours)  # torch's own classes
    assert isinstance(theirs, Metadata) and theirs.state_dict_metadata["a"].properties.dtype is torch.bfloat16
    assert theirs.state_dict_metadata["a"].size == torch.Size([2, 3])
