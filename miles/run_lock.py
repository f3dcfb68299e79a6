"""One live run per run directory: an exclusive lock file that records the holder's pid.

    with RunLock([run_dir, save_dir]) as lock:   # UserError (exit 2, naming --run-id) when taken
        ...train...
    holder("runs/x")                             # who holds it now (for --dry-run), or None

The lock is `fcntl.flock` on `<dir>/.miles-run.lock`, so the kernel releases it when the holder
dies by any means (SIGKILL included): there is no stale lock to clean by hand. The file's content
(pid, host, start time, command) only serves the message a second run prints; the file itself is
never deleted (deleting a lock file races with the next run opening it). A directory the lock
created is removed again on exit when nothing but miles' own bookkeeping files (`BOOKKEEPING`) ended
up in it, so a run that fails before it starts leaves no directory behind.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import shlex
import shutil
import socket
import sys
import time
from pathlib import Path
from types import TracebackType

from miles.errors import UserError

LOCK_FILE = ".miles-run.lock"
RUN_RECORD = "run.json"  # written by miles.run_identity; listed here so an unstarted run's dir is removed
BOOKKEEPING = frozenset({LOCK_FILE, RUN_RECORD})


def _describe(info: dict) -> str:
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(info["started"])) if info.get("started") else "?"
    where = f" on {info['host']}" if info.get("host") and info.get("host") != socket.gethostname() else ""
    command = f", `{info['command']}`" if info.get("command") else ""
    return f"pid {info.get('pid', '?')}{where}, started {started}{command}"


def _read_info(path: Path) -> dict:
    try:
        return json.loads(path.read_text() or "{}")
    except (OSError, ValueError):
        return {}


def holder(directory: str | os.PathLike[str]) -> dict | None:
    """The record of the live run holding `directory`, or None. Creates nothing."""
    path = Path(directory) / LOCK_FILE
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError as e:
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            return _read_info(path) or {"pid": "?"}
        raise
    finally:
        os.close(fd)
    return None


def in_use_error(directory: Path, info: dict) -> UserError:
    return UserError(
        f"{directory} is in use by a live run ({_describe(info)}); wait for it to end, stop it, "
        "or give this run another --run-id.",
        option="--run-id",
    )


class RunLock:
    """Hold the run lock of every directory in `directories` (created if missing) until exit."""

    def __init__(self, directories: list[str | os.PathLike[str]]):
        self.directories = list(dict.fromkeys(Path(d).absolute() for d in directories))
        self._fds: list[int] = []
        self._created: list[Path] = []

    def __enter__(self) -> RunLock:
        try:
            for d in self.directories:
                self._lock(d)
        except BaseException:
            self.release(failed=True)
            raise
        return self

    def _lock(self, directory: Path) -> None:
        missing = [p for p in (directory, *directory.parents) if not p.exists()]
        directory.mkdir(parents=True, exist_ok=True)
        self._created.extend(missing)  # deepest first
        path = directory / LOCK_FILE
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise in_use_error(directory, _read_info(path) or {"pid": "?"}) from None
            raise
        info = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "started": time.time(),
            "command": "miles " + shlex.join(sys.argv[1:]),
        }
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(info).encode(), 0)
        self._fds.append(fd)

    def release(self, *, failed: bool = False) -> None:
        for fd in self._fds:
            os.close(fd)  # closing the last descriptor releases the flock
        self._fds.clear()
        if failed:
            for d in self._created:  # deepest first
                if d.is_dir() and set(os.listdir(d)) <= BOOKKEEPING:
                    shutil.rmtree(d, ignore_errors=True)
        self._created.clear()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.release(failed=exc_type is not None)
