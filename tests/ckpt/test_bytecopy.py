"""bytecopy.py: byte ranges land bit for bit whichever copy method the file system allows; row blocks."""

from __future__ import annotations

import errno
import os

import pytest

from miles.ckpt.convert import bytecopy
from miles.ckpt.convert.bytecopy import OutputFile, Segment, Source, gather_rows, take_rows


@pytest.fixture
def src(tmp_path):
    path = tmp_path / "src.bin"
    path.write_bytes(os.urandom(3 * 1024 * 1024 + 17))
    yield path
    bytecopy.SOURCES.close()


def _copy(tmp_path, src, ranges, name="out.bin"):
    out = OutputFile(tmp_path / name)
    out.write(b"head")
    for off, n in ranges:
        out.copy(Segment(src, off, n))
    out.write(memoryview(b"tail"))
    pos = out.pos
    out.close()
    return (tmp_path / name).read_bytes(), pos


@pytest.mark.parametrize("method", bytecopy.METHODS)
def test_every_copy_method_moves_the_exact_bytes(tmp_path, src, monkeypatch, method):
    monkeypatch.setattr(bytecopy, "method", method)
    monkeypatch.setattr(bytecopy, "_BUF", 4096)  # the read/write fallback loops many times
    data = src.read_bytes()
    ranges = [(0, 5), (1_000_003, 2 * 1024 * 1024), (len(data) - 17, 17), (7, 0)]
    got, pos = _copy(tmp_path, src, ranges)
    assert got == b"head" + b"".join(data[o:o + n] for o, n in ranges) + b"tail"
    assert pos == len(got)


def test_a_refused_method_falls_back_to_the_next(tmp_path, src, monkeypatch):
    def refuse(*a, **k):
        raise OSError(errno.EXDEV, "cross-device")

    monkeypatch.setattr(bytecopy, "method", "copy_file_range")
    monkeypatch.setattr(os, "copy_file_range", refuse)
    got, _ = _copy(tmp_path, src, [(10, 100_000)])
    assert got == b"head" + src.read_bytes()[10:100_010] + b"tail"
    assert bytecopy.method == "sendfile"
    monkeypatch.setattr(bytecopy, "method", "copy_file_range")


def test_a_truncated_source_is_an_error_not_a_short_file(tmp_path, src):
    with pytest.raises(OSError, match="ends before byte"):
        _copy(tmp_path, src, [(src.stat().st_size - 10, 20)])


def test_gather_and_take_rows(tmp_path):
    # Two 4-row tensors of 3 int8 columns in one file; rows move as byte blocks.
    path = tmp_path / "t.bin"
    path.write_bytes(bytes(range(24)))
    a = Source("int8", (4, 3), (Segment(path, 0, 12),))
    b = Source("int8", (4, 3), (Segment(path, 12, 12),))
    fused = gather_rows([a, b], [(1, 2, 2), (0, 0, 1), (0, 1, 3)])
    assert fused.shape == (6, 3)
    # Adjacent ranges merge: b's rows 2-3, then a's rows 0-3 in one range.
    assert fused.segments == (Segment(path, 18, 6), Segment(path, 0, 12))
    back = take_rows(fused, [(2, 4)])
    assert back.shape == (4, 3) and back.segments == (Segment(path, 0, 12),)
    across = take_rows(fused, [(1, 2)])  # crosses from the first range into the second
    assert across.segments == (Segment(path, 21, 3), Segment(path, 0, 3))
    with pytest.raises(ValueError, match="dtype or row shape"):
        gather_rows([a, Source("int16", (4, 3), (Segment(path, 0, 24),))], [(0, 0, 1)])
