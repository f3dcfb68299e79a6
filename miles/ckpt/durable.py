"""Durability helpers shared by the checkpoint writers: fsync a file or a directory by path, and publish a
completed temporary directory under its final name.

A file's bytes are durable once the file is fsynced; a rename (how every writer here publishes a
complete output) is durable once the directory holding the entry is fsynced too.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path


def fsync_path(path: str | os.PathLike[str] | Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def publish_dir(tmp: Path, out: Path) -> None:
    """Make the complete directory `tmp` durable and rename it to `out`, replacing an older `out` only
    once the new one is in place (a crash leaves either the old output or the new one, never half)."""
    for f in tmp.rglob("*"):
        if f.is_file():
            fsync_path(f)
    fsync_path(tmp)
    if out.exists():
        old = out.parent / f"{out.name}.old-{os.getpid()}"
        os.rename(out, old)
        os.rename(tmp, out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, out)
    fsync_path(out.parent)
