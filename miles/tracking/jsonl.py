"""The always-on metrics file: `<run_dir>/metrics.jsonl`, one JSON object per step.

Each line is `{"step": <int>, "time": <unix seconds>, "<metric>": <float>, ...}`, holding every metric
logged for that step (several `Tracker.log` calls of one step merge into its line; `time` is when its
last metrics were logged, the end of the step), so
`pandas.read_json(path, lines=True)` gives one row per step. The file is opened
for appending so a resumed run continues it; `resume_step=N` first drops every line with
`step >= N` (those steps are about to be redone), rewriting the file atomically (temp + rename).
A last line without its newline (the process was killed mid-write) is dropped on open, with a
warning, so the file never holds a glued or half-written record. Non-finite values are written as
`NaN` / `Infinity` (what Python's `json` reads back; strict JSON parsers need `allow_nan`).

`read_metrics(path)` reads the file back (used by the plot and by tests).
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"


def _parse(line: str | bytes, path: Path, lineno: int) -> dict[str, Any]:
    try:
        record = json.loads(line)
        int(record["step"])
    except (ValueError, TypeError, KeyError):
        raise ValueError(f"{path}:{lineno}: not a metrics record (a JSON object with a step): {line[:80]!r}") from None
    return record


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """Every complete record of a metrics JSONL file, in file order (a torn last line is skipped)."""
    path = Path(path)
    records = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if line.endswith("\n") and line.strip():
                records.append(_parse(line, path, lineno))
    return records


def _prepare(path: Path, resume_step: int | None) -> None:
    """Drop a torn last line, and with `resume_step`, every record with step >= resume_step."""
    if not path.exists():
        return
    raw = path.read_bytes()
    lines = raw.split(b"\n")
    torn = lines.pop()  # b"" when the file ends with a newline
    if torn:
        log.warning("%s: dropping a torn last line (%d bytes) left by an interrupted write", path, len(torn))
    records = [(line, i) for i, line in enumerate(lines, 1) if line.strip()]
    if resume_step is not None:
        records = [(line, i) for line, i in records if _parse(line, path, i)["step"] < resume_step]
    kept = [line for line, _ in records]
    if not torn and len(kept) == sum(1 for line in lines if line.strip()):
        return  # nothing to change: keep the file (and its inode) as it is
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("wb") as f:
        f.write(b"".join(line + b"\n" for line in kept))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class JsonlSink:
    """Writes one line per step: a `log` of the step just written merges into that line (the driver logs
    a step's training metrics before its checkpoint and its eval after it). Every call reaches the file
    at once, so a crash loses at most what had not been logged yet."""

    name = "jsonl"

    def __init__(self, run_dir: Path, *, resume_step: int | None = None):
        self.path = run_dir / METRICS_FILE
        self.path.parent.mkdir(parents=True, exist_ok=True)
        _prepare(self.path, resume_step)
        self._file: int | None = os.open(self.path, os.O_WRONLY | os.O_CREAT, 0o644)
        self._end = os.lseek(self._file, 0, os.SEEK_END)
        # The line last written by this sink: where it starts and what it holds (a step begun by an
        # earlier process is never merged into: its line may be a killed run's).
        self._last: tuple[int, dict[str, Any]] | None = None

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        if self._file is None:
            raise RuntimeError(f"{self.path}: log() after finish()")
        if self._last is not None and self._last[1]["step"] == step:
            start, record = self._last[0], {**self._last[1], **metrics, "time": time.time()}
        else:
            start, record = self._end, {"step": step, "time": time.time(), **metrics}
        line = (json.dumps(record) + "\n").encode()
        # One write of the whole line over the old one, so a process killed here leaves the old line
        # or the new one, never a mix.
        os.pwrite(self._file, line, start)
        if start + len(line) < self._end:  # a merged value printed shorter than the one it replaced
            os.ftruncate(self._file, start + len(line))
        self._end = start + len(line)
        self._last = (start, record)

    def close(self, status: str) -> None:
        if self._file is not None:
            os.close(self._file)
            self._file = None
