"""Read-only view of a trainer checkpoint directory: which checkpoint the tracker names, and where.

The writer (`miles.ckpt.trainer_checkpoint.save_checkpoint`) is the only code that changes a
checkpoint directory, cleaning what an interrupted save left (`.tmp-*`, `.replaced-*`). Readers
(`--load` at start, `miles eval --checkpoint`, input validation) use this module, which never
creates, renames or deletes anything, so pointing a reader at a live run cannot destroy the save
that run has in progress. It imports no torch: `miles ... --dry-run` and the checks before Ray use it.

    latest = latest_checkpoint("runs/x/checkpoints", flag="--load")   # None when there is none
    if latest: latest.rollout_id, latest.path                          # path holds the files
"""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path

from miles.errors import UserError

TRACKER = "latest_checkpointed_iteration.txt"
STATE_FILE = "trainer_state.pt"
EXTRA_FILE = "extra.json"
TMP_PREFIX = ".tmp-"
# An older checkpoint of the same id moved aside while its replacement is renamed in. A writer
# killed between the two renames leaves only this one; readers read it where it is, the next
# writer renames it back.
REPLACED_PREFIX = ".replaced-"
ITER_RE = re.compile(r"^iter_(\d{7,})$")


def iter_dir_name(rollout_id: int) -> str:
    return f"iter_{rollout_id:07d}"


@dataclasses.dataclass(frozen=True)
class LatestCheckpoint:
    rollout_id: int
    path: Path  # the directory holding STATE_FILE and EXTRA_FILE


def read_tracker(save_dir: str | os.PathLike[str], *, flag: str = "--load") -> int | None:
    """The rollout id the tracker names, None when there is no tracker; garbage is a `UserError`."""
    tracker = Path(save_dir) / TRACKER
    if not tracker.is_file():
        return None
    try:
        text = tracker.read_text().strip()
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"{flag} {save_dir}: cannot read {TRACKER} ({e}); fix the file or point {flag} elsewhere.", option=flag) from None
    if not text.isdigit():
        raise UserError(
            f"{flag} {save_dir}: {TRACKER} holds {text[:40]!r}, not a rollout id; write the id of a complete "
            f"iter_* directory into it or point {flag} at another checkpoint directory.",
            option=flag,
        )
    return int(text)


def list_checkpoints(save_dir: str | os.PathLike[str]) -> list[int]:
    """Rollout ids of the complete (renamed) `iter_*` directories, ascending."""
    save_dir = Path(save_dir)
    if not save_dir.is_dir():
        return []
    return sorted(int(m.group(1)) for e in save_dir.iterdir() if (m := ITER_RE.match(e.name)) and e.is_dir())


def _complete(path: Path) -> bool:
    # extra.json is written into the temporary directory before the rename that publishes it, and the
    # trainer state is either one STATE_FILE or per-rank shards (torch DCP / torch_dist), so a
    # published directory with extra.json is complete.
    return (path / EXTRA_FILE).is_file()


def latest_checkpoint(save_dir: str | os.PathLike[str], *, flag: str = "--load") -> LatestCheckpoint | None:
    """The checkpoint the tracker names, or None when the directory or its tracker is missing.

    A tracker naming a checkpoint that is not there (or not complete) is a `UserError` naming `flag`.
    """
    save_dir = Path(save_dir)
    if not save_dir.is_dir():
        return None
    rollout_id = read_tracker(save_dir, flag=flag)
    if rollout_id is None:
        return None
    name = iter_dir_name(rollout_id)
    for candidate in (save_dir / name, save_dir / f"{REPLACED_PREFIX}{name}"):
        if _complete(candidate):
            return LatestCheckpoint(rollout_id, candidate)
    raise UserError(
        f"{flag} {save_dir}: {TRACKER} names rollout {rollout_id} but {name} is missing or incomplete; "
        f"restore that directory or point {flag} at another checkpoint directory.",
        option=flag,
    )
