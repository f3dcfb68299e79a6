"""Move tensor bytes between files inside the kernel, into output files that are on disk before they count.

The converter never needs a tensor's values, only its bytes in a new place: a safetensors tensor becomes
a `torch.save` record's data, and the fused megatron tensors (QKV per query group, gate ‖ up) are
row-block permutations of their HF parts along dim 0 of row-major tensors, so every output tensor is
a list of byte ranges of the inputs. This module moves those ranges:

- `Segment(path, offset, nbytes)`, `Source(dtype, shape, segments)`: a tensor's bytes, in order, as
  ranges of files;
- `OutputFile(path)`: a sequential writer on a raw descriptor. `copy(segment)` uses
  `os.copy_file_range` (the page cache copies to the page cache; no byte passes through this process,
  like coreutils `cp`), falling back to `os.sendfile` and then to `pread`/`write` where a file system
  refuses. Every `SYNC_BYTES` it asks the kernel to start writing the new range back
  (`sync_file_range(SYNC_FILE_RANGE_WRITE)`, which does not wait; where libc lacks it, a background
  thread runs `fdatasync`), so writeback overlaps the copying; `close()` `fsync`s, so the data is on
  disk before the caller writes the index that points at it. Measured on the 1 GB benchmark: the
  closing fsync alone (no early writeback) cost 1.3 s over no fsync at all, the background fdatasync
  every 64-256 MiB 0.4-0.5 s, sync_file_range every 32 MiB 0.2 s.

Not meant to be run on its own; tests/ckpt/test_bytecopy.py checks each copy method bit for bit.
"""

from __future__ import annotations

import errno
import os
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

# bench/convert.py turns this off in its own child process to measure what durability costs; nothing
# else does (a conversion whose tracker can point at data still in the page cache is not durable).
DURABLE = True
# Bytes written between requests to start writeback: large enough to be few calls, small enough that
# the disk is busy from the start and the closing fsync has little left to wait for.
SYNC_BYTES = 32 * 1024**2
_SYNC_FILE_RANGE_WRITE = 2  # <linux/fs.h>
_CHUNK = 1 << 30  # the most one copy_file_range/sendfile call is asked to move
_BUF = 8 * 1024**2  # the pread/write fallback's buffer
# copy_file_range -> sendfile -> readwrite: the first method that works, remembered per process.
# Tests set this to check each method.
METHODS = ("copy_file_range", "sendfile", "readwrite")
method = METHODS[0]
_REFUSED = {errno.EXDEV, errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EPERM, errno.ETXTBSY, errno.EBADF}


@dataclass(frozen=True)
class Segment:
    path: Path
    offset: int
    nbytes: int


@dataclass(frozen=True)
class Source:
    """A tensor's row-major little-endian bytes, as consecutive file ranges."""

    dtype: str
    shape: tuple[int, ...]
    segments: tuple[Segment, ...]

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.segments)


class _Sources:
    """Read-only descriptors of the input files, opened once per conversion."""

    def __init__(self) -> None:
        self._fds: dict[Path, int] = {}

    def fd(self, path: Path) -> int:
        fd = self._fds.get(path)
        if fd is None:
            fd = self._fds[path] = os.open(path, os.O_RDONLY)
        return fd

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


SOURCES = _Sources()


def read_segment(seg: Segment) -> bytes:
    """The bytes of one segment (small reads only: headers, the torch fallback)."""
    return os.pread(SOURCES.fd(seg.path), seg.nbytes, seg.offset)


class OutputFile:
    """A file written front to back with `write` and `copy`; `close` returns once it is on disk."""

    def __init__(self, path: Path):
        self.path = path
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self.pos = 0
        self._synced_to = 0
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def write(self, data) -> None:
        view = memoryview(data)
        if view.ndim != 1 or view.format != "B":
            view = view.cast("B")
        while view:
            n = os.write(self.fd, view)
            view = view[n:]
            self.pos += n
        self._maybe_sync()

    def copy(self, seg: Segment) -> None:
        global method
        src, off, left = SOURCES.fd(seg.path), seg.offset, seg.nbytes
        while left:
            want = min(left, _CHUNK)
            try:
                if method == "copy_file_range":
                    n = os.copy_file_range(src, self.fd, want, off)
                elif method == "sendfile":
                    n = os.sendfile(self.fd, src, off, want)
                else:
                    data = os.pread(src, min(want, _BUF), off)
                    n = len(data)
                    if n:
                        self._write_all(data)
            except OSError as e:
                if e.errno not in _REFUSED or method == METHODS[-1]:
                    raise
                method = METHODS[METHODS.index(method) + 1]
                continue
            if n == 0:
                raise OSError(errno.EIO, f"{seg.path} ends before byte {off + want} (truncated file?)")
            off += n
            left -= n
            self.pos += n
        self._maybe_sync()

    def _write_all(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            view = view[os.write(self.fd, view):]

    def _maybe_sync(self) -> None:
        if not DURABLE or self.pos - self._synced_to < SYNC_BYTES:
            return
        start_writeback = _sync_file_range()
        if start_writeback is not None:
            if start_writeback(self.fd, self._synced_to, self.pos - self._synced_to, _SYNC_FILE_RANGE_WRITE) == 0:
                self._synced_to = self.pos
                return
        if self._thread is not None and self._thread.is_alive():
            return
        self._synced_to = self.pos
        self._thread = threading.Thread(target=self._sync, name="convert-writeback", daemon=True)
        self._thread.start()

    def _sync(self) -> None:
        try:
            os.fdatasync(self.fd)
        except BaseException as e:  # re-raised on the writing thread by close()
            self._error = e

    def close(self, *, sync: bool = True) -> None:
        if self.fd < 0:
            return
        try:
            if self._thread is not None:
                self._thread.join()
            if self._error is not None:
                raise self._error
            if sync and DURABLE:
                # The index written after this points at these bytes: they must be on disk first.
                os.fsync(self.fd)
        finally:
            os.close(self.fd)
            self.fd = -1


_SFR: list = []


def _sync_file_range():
    """libc's sync_file_range (Linux), or None."""
    if not _SFR:
        fn = None
        if sys.platform.startswith("linux"):
            try:
                import ctypes

                fn = ctypes.CDLL(None, use_errno=True).sync_file_range
                fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
                fn.restype = ctypes.c_int
            except (OSError, AttributeError):
                fn = None
        _SFR.append(fn)
    return _SFR[0]


def fsync_dir(path: Path) -> None:
    """Make the entries of directory `path` (new files, renames) durable."""
    if not DURABLE:
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_durably(path: Path, data: bytes) -> None:
    """A small file written and fsynced (its directory is fsynced by whoever publishes it)."""
    out = OutputFile(path)
    try:
        out.write(data)
    finally:
        out.close()


def _row_bytes(src: Source) -> int:
    from miles.ckpt.convert.torch_format import DTYPES, numel

    return numel(src.shape[1:]) * DTYPES[src.dtype].itemsize


def _byte_range(src: Source, start: int, n: int) -> list[Segment]:
    """Bytes [start, start + n) of `src`, as ranges of its files."""
    out = []
    for seg in src.segments:
        if n <= 0:
            break
        if start >= seg.nbytes:
            start -= seg.nbytes
            continue
        take = min(n, seg.nbytes - start)
        out.append(Segment(seg.path, seg.offset + start, take))
        n -= take
        start = 0
    if n > 0:
        raise ValueError("byte range past the end of its source")
    return out


def merged(segments: list[Segment]) -> tuple[Segment, ...]:
    """The same bytes in as few ranges as possible (adjacent ranges of one file joined)."""
    out: list[Segment] = []
    for s in segments:
        if out and out[-1].path == s.path and out[-1].offset + out[-1].nbytes == s.offset:
            out[-1] = Segment(s.path, out[-1].offset, out[-1].nbytes + s.nbytes)
        elif s.nbytes:
            out.append(s)
    return tuple(out)


def gather_rows(parts: list[Source], blocks: list[tuple[int, int, int]]) -> Source:
    """A tensor whose rows (dim 0) are `blocks` = (part, first row, row count) of `parts`, in order."""
    row = _row_bytes(parts[0])
    if any(p.dtype != parts[0].dtype or _row_bytes(p) != row for p in parts):
        raise ValueError("parts of one fused tensor differ in dtype or row shape")
    segs: list[Segment] = []
    for part, first, n in blocks:
        segs += _byte_range(parts[part], first * row, n * row)
    rows = sum(n for _, _, n in blocks)
    return Source(parts[0].dtype, (rows, *parts[0].shape[1:]), merged(segs))


def take_rows(src: Source, blocks: list[tuple[int, int]]) -> Source:
    """The tensor made of rows `blocks` = (first row, row count) of `src`, in order."""
    row = _row_bytes(src)
    segs: list[Segment] = []
    for first, n in blocks:
        segs += _byte_range(src, first * row, n * row)
    return Source(src.dtype, (sum(n for _, n in blocks), *src.shape[1:]), merged(segs))

