"""Durability helper shared by the checkpoint writers: fsync a file or a directory by path.

A file's bytes are durable once the file is fsynced; a rename (how every writer here publishes a
complete output) is durable once the directory holding the entry is fsynced too.
"""

from __future__ import annotations

import os
from pathlib import Path


def fsync_path(path: str | os.PathLike[str] | Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
