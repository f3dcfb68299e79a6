"""Atomic trainer checkpoints: `<save_dir>/iter_<rollout_id:07d>/` plus a tracker file.

Layout (the tracker name is the one upstream miles and Megatron use):

    <save_dir>/latest_checkpointed_iteration.txt   the rollout id of the last complete checkpoint
    <save_dir>/iter_0000007/...                    the trainer's per-rank state, written by every
                                                   training rank itself (torch backend: a
                                                   torch.distributed.checkpoint, `.metadata` +
                                                   `__<rank>_0.distcp`; megatron: torch_dist)
    <save_dir>/iter_0000007/extra.json             the driver's data: data-source position, ... (json)

The trainer's state never passes through the driver: the driver calls `begin_checkpoint` (a fresh
temporary directory), every rank writes its own shard into it (`TrainerBackend.save_checkpoint`),
then the driver calls `commit_checkpoint` (extra.json, fsync, rename, tracker). `save_checkpoint`
does all three for a state dict held in one process (`trainer_state.pt`, torch.save).

Crash safety: a checkpoint is written into `<save_dir>/.tmp-iter_<id>-<pid>/`, every file fsynced,
the directory renamed to `iter_<id>` only when complete, and the tracker rewritten (temp file +
`os.replace`) last. A SIGKILL at any moment leaves either the previous tracker (the new directory is
ignored) or the new one pointing at a complete directory. Temp directories left by a killed writer
are removed by the next save (`begin_checkpoint`); loading never changes the directory (a reader
pointed at a live run must not delete its save in progress; see `miles.ckpt.checkpoint_dir`). The
tracker is the only source of truth: an `iter_*` directory it does not name is never loaded.

Not here: the HF export (`miles.ckpt.hf_export`) and the megatron `torch_dist` format.

Use:

    tmp = begin_checkpoint(save_dir, rollout_id)
    ... every training rank: backend.save_checkpoint(str(tmp)) ...
    commit_checkpoint(save_dir, rollout_id, tmp, {"data_position": 12}, keep_last=3)
    found = find_latest_checkpoint(save_dir)        # None when nothing complete is there
    if found: rollout_id, directory, extra = found  # every rank: backend.load_checkpoint(str(directory))
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

from miles.ckpt.durable import fsync_path
from miles.ckpt.checkpoint_dir import (  # noqa: F401  (re-exported: the names callers know)
    EXTRA_FILE,
    REPLACED_PREFIX as _REPLACED_PREFIX,
    STATE_FILE,
    TMP_PREFIX as _TMP_PREFIX,
    TRACKER,
    iter_dir_name,
    latest_checkpoint,
    list_checkpoints,
    read_tracker,
)
from miles.errors import UserError

logger = logging.getLogger(__name__)

def _clean_temp_dirs(save_dir: Path) -> None:
    """Remove what interrupted saves left. Only the writer calls this: the run lock makes it the only one."""
    for entry in save_dir.iterdir():
        if entry.name.startswith(_TMP_PREFIX) and entry.is_dir():
            logger.warning("removing incomplete checkpoint %s (left by an interrupted save)", entry)
            shutil.rmtree(entry, ignore_errors=True)
        elif entry.name.startswith(f"{_TMP_PREFIX}{TRACKER}-"):
            entry.unlink(missing_ok=True)


def _recover_replaced(save_dir: Path) -> None:
    for entry in save_dir.glob(f"{_REPLACED_PREFIX}iter_*"):
        final = save_dir / entry.name[len(_REPLACED_PREFIX) :]
        if final.exists():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            logger.warning("restoring %s: a re-save of the same rollout id was interrupted", final)
            os.rename(entry, final)


def begin_checkpoint(save_dir: str | os.PathLike[str], rollout_id: int) -> Path:
    """Create (and return) the temporary directory the trainer ranks write the checkpoint of
    `rollout_id` into. Leftovers of interrupted saves are cleaned first."""
    save_dir = Path(save_dir)
    save_dir.mkdir(parents=True, exist_ok=True)
    _recover_replaced(save_dir)
    _clean_temp_dirs(save_dir)
    tmp = save_dir / f"{_TMP_PREFIX}{iter_dir_name(rollout_id)}-{os.getpid()}"
    tmp.mkdir()
    return tmp


def commit_checkpoint(
    save_dir: str | os.PathLike[str],
    rollout_id: int,
    tmp: Path,
    extra: dict[str, Any],
    *,
    keep_last: int | None = None,
) -> Path:
    """Finish the checkpoint in `tmp` (from `begin_checkpoint`, filled by every rank): write
    `extra.json`, fsync everything, rename it to `iter_<id>`, point the tracker at it; returns its dir.

    `extra` must be json-able. With `keep_last=N`, complete checkpoints older than the newest N are
    deleted after the tracker moved.
    """
    if keep_last is not None and keep_last < 1:
        raise ValueError(f"keep_last must be at least 1, got {keep_last}")
    extra_text = json.dumps(extra, indent=2, sort_keys=True)
    save_dir = Path(save_dir)
    (tmp / EXTRA_FILE).write_text(extra_text)
    for f in sorted(tmp.rglob("*")):
        if f.is_file():
            fsync_path(f)
    fsync_path(tmp)

    final = save_dir / iter_dir_name(rollout_id)
    if final.exists():
        # Re-saving an id: move the old one aside first; a crash between the two renames leaves the
        # old directory under `.replaced-`, which `_recover_replaced` puts back.
        trash = save_dir / f"{_REPLACED_PREFIX}{final.name}"
        os.rename(final, trash)
        os.rename(tmp, final)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        os.rename(tmp, final)
    fsync_path(save_dir)

    tracker_tmp = save_dir / f"{_TMP_PREFIX}{TRACKER}-{os.getpid()}"
    tracker_tmp.write_text(f"{rollout_id}\n")
    fsync_path(tracker_tmp)
    os.replace(tracker_tmp, save_dir / TRACKER)
    fsync_path(save_dir)

    if keep_last is not None:
        for old in list_checkpoints(save_dir)[:-keep_last]:
            if old != rollout_id:
                shutil.rmtree(save_dir / iter_dir_name(old), ignore_errors=True)
    return final


def save_checkpoint(
    save_dir: str | os.PathLike[str],
    rollout_id: int,
    trainer_state: dict[str, Any],
    extra: dict[str, Any],
    *,
    keep_last: int | None = None,
) -> Path:
    """Write a state dict held in this process as the checkpoint of `rollout_id` (atomically; see
    `commit_checkpoint`). `extra` is checked to be json-able before anything is written."""
    json.dumps(extra)
    if keep_last is not None and keep_last < 1:
        raise ValueError(f"keep_last must be at least 1, got {keep_last}")
    tmp = begin_checkpoint(save_dir, rollout_id)
    import torch  # here: the driver imports this module for the tracker protocol alone

    torch.save(trainer_state, tmp / STATE_FILE)
    return commit_checkpoint(save_dir, rollout_id, tmp, extra, keep_last=keep_last)


def find_latest_checkpoint(
    load_dir: str | os.PathLike[str], *, flag: str = "--load"
) -> tuple[int, Path, dict[str, Any]] | None:
    """`(rollout_id, directory, extra)` of the checkpoint the tracker names, or None when the
    directory or the tracker is missing. Reads only: nothing in `load_dir` is created, renamed or removed."""
    found = latest_checkpoint(load_dir, flag=flag)
    if found is None:
        if list_checkpoints(load_dir):
            logger.warning("%s has iter_* directories but no %s; not resuming from them", load_dir, TRACKER)
        return None
    return found.rollout_id, found.path, json.loads((found.path / EXTRA_FILE).read_text())


def load_latest_checkpoint(
    load_dir: str | os.PathLike[str], *, flag: str = "--load"
) -> tuple[int, dict[str, Any], dict[str, Any]] | None:
    """`(rollout_id, trainer_state, extra)` of a checkpoint written by `save_checkpoint` (one state
    file), or None when nothing complete is there. Reads only."""
    found = find_latest_checkpoint(load_dir, flag=flag)
    if found is None:
        return None
    rollout_id, ckpt, extra = found
    if not (ckpt / STATE_FILE).is_file():
        raise UserError(
            f"{flag} {load_dir}: {ckpt.name} has no {STATE_FILE}; it holds a per-rank trainer checkpoint, "
            "which the trainer loads itself.",
            option=flag,
        )
    import torch

    return rollout_id, torch.load(ckpt / STATE_FILE, map_location="cpu", weights_only=True), extra
