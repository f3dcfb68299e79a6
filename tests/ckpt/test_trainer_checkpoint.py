"""Atomic trainer checkpoints: round trip, tracker-last ordering, interrupted saves, keep-last-N."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from miles.ckpt.trainer_checkpoint import (
    TRACKER,
    list_checkpoints,
    load_latest_checkpoint,
    read_tracker,
    save_checkpoint,
)
from miles.errors import UserError

torch.set_num_threads(1)


def state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "format": "test",
        "model": {"w": torch.randn(4, 3, generator=g), "b": torch.randn(3, generator=g).to(torch.bfloat16)},
        "optimizer": {"state": {0: {"step": torch.tensor(7.0)}}, "param_groups": [{"lr": 0.1, "params": [0]}]},
        "rng": {"python": {"version": 3, "internal": [1, 2, 3], "gauss_next": None}},
    }


def test_round_trip_is_bit_exact_and_tracker_names_the_checkpoint(tmp_path):
    s = state(0)
    path = save_checkpoint(tmp_path, 12, s, {"data_position": 96, "epoch": 0})
    assert path == tmp_path / "iter_0000012"
    assert (tmp_path / TRACKER).read_text().strip() == "12"
    rollout_id, loaded, extra = load_latest_checkpoint(tmp_path)
    assert rollout_id == 12 and extra == {"data_position": 96, "epoch": 0}
    assert torch.equal(loaded["model"]["w"], s["model"]["w"])
    assert loaded["model"]["b"].dtype == torch.bfloat16 and torch.equal(loaded["model"]["b"], s["model"]["b"])
    assert loaded["optimizer"] == s["optimizer"] and loaded["rng"] == s["rng"]
    assert sorted(os.listdir(tmp_path)) == ["iter_0000012", TRACKER]  # no temp files left


def test_latest_follows_the_tracker(tmp_path):
    for rid in (1, 2, 3):
        save_checkpoint(tmp_path, rid, state(rid), {"rid": rid})
    rollout_id, loaded, extra = load_latest_checkpoint(tmp_path)
    assert rollout_id == 3 and extra == {"rid": 3} and torch.equal(loaded["model"]["w"], state(3)["model"]["w"])


def test_nothing_to_load(tmp_path):
    assert load_latest_checkpoint(tmp_path / "missing") is None
    assert load_latest_checkpoint(tmp_path) is None


def _snapshot(root):
    return sorted((str(p.relative_to(root)), p.stat().st_mtime_ns, p.stat().st_size) for p in root.rglob("*"))


def test_a_temp_dir_left_by_a_killed_save_is_ignored_by_readers_and_removed_by_the_next_save(tmp_path):
    save_checkpoint(tmp_path, 4, state(4), {"rid": 4})
    # what a writer killed mid-save leaves (or a live writer has in progress): a temp directory with a
    # partial state file, and a tracker temp file; the tracker itself is untouched
    partial = tmp_path / ".tmp-iter_0000005-4242"
    partial.mkdir()
    (partial / "trainer_state.pt").write_bytes(b"\x80\x02truncated")
    (tmp_path / f".tmp-{TRACKER}-4242").write_text("5\n")
    before = _snapshot(tmp_path)
    rollout_id, _, extra = load_latest_checkpoint(tmp_path)
    assert (rollout_id, extra) == (4, {"rid": 4})
    assert _snapshot(tmp_path) == before  # a reader changes nothing
    save_checkpoint(tmp_path, 5, state(5), {"rid": 5})
    assert not any(p.name.startswith(".tmp-") for p in tmp_path.iterdir())


def test_a_renamed_dir_without_tracker_update_is_not_loaded(tmp_path):
    save_checkpoint(tmp_path, 4, state(4), {"rid": 4})
    save_checkpoint(tmp_path / "other", 5, state(5), {"rid": 5})
    os.rename(tmp_path / "other" / "iter_0000005", tmp_path / "iter_0000005")  # killed before the tracker moved
    assert load_latest_checkpoint(tmp_path)[0] == 4


def test_sigkill_during_save_keeps_the_previous_checkpoint(tmp_path):
    """A real SIGKILL: the child kills itself after the state file is written, before the rename."""
    save_checkpoint(tmp_path, 1, state(1), {"rid": 1})
    script = textwrap.dedent(
        f"""
        import os, signal, torch
        import miles.ckpt.trainer_checkpoint as tc
        real_fsync = tc.fsync_path
        def die_after_files_are_written(path):
            if path.name.startswith(".tmp-iter_"):  # the temp dir itself: its files are already synced
                os.kill(os.getpid(), signal.SIGKILL)
            real_fsync(path)
        tc.fsync_path = die_after_files_are_written
        tc.save_checkpoint({str(tmp_path)!r}, 2, {{"model": {{"w": torch.ones(1000)}}}}, {{"rid": 2}})
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], timeout=120)
    assert proc.returncode == -9
    assert any(p.name.startswith(".tmp-iter_0000002") for p in tmp_path.iterdir())  # the kill left debris
    rollout_id, _, extra = load_latest_checkpoint(tmp_path)
    assert (rollout_id, extra) == (1, {"rid": 1})
    save_checkpoint(tmp_path, 2, state(2), {"rid": 2})  # the next save works normally and cleans up
    assert read_tracker(tmp_path) == 2
    assert not any(p.name.startswith(".tmp-") for p in tmp_path.iterdir())


def test_keep_last_deletes_older_complete_checkpoints(tmp_path):
    for rid in range(5):
        save_checkpoint(tmp_path, rid, state(rid), {}, keep_last=2)
    assert list_checkpoints(tmp_path) == [3, 4]
    assert load_latest_checkpoint(tmp_path)[0] == 4


def test_resaving_an_id_replaces_it_and_an_interrupted_resave_is_recovered(tmp_path):
    save_checkpoint(tmp_path, 3, state(1), {"v": 1})
    save_checkpoint(tmp_path, 3, state(2), {"v": 2})
    assert load_latest_checkpoint(tmp_path)[2] == {"v": 2}
    # killed between moving the old one aside and renaming the new one in
    os.rename(tmp_path / "iter_0000003", tmp_path / ".replaced-iter_0000003")
    before = _snapshot(tmp_path)
    assert load_latest_checkpoint(tmp_path)[2] == {"v": 2}  # read where it lies ...
    assert _snapshot(tmp_path) == before  # ... without renaming it back
    save_checkpoint(tmp_path, 4, state(4), {"v": 4})  # the writer puts it back
    assert list_checkpoints(tmp_path) == [3, 4] and not (tmp_path / ".replaced-iter_0000003").exists()


def test_extra_that_is_not_json_fails_before_writing(tmp_path):
    with pytest.raises(TypeError):
        save_checkpoint(tmp_path, 1, state(1), {"bad": object()})
    assert not tmp_path.exists() or not any(tmp_path.iterdir())


def test_tracker_naming_a_missing_checkpoint_is_a_user_error(tmp_path):
    save_checkpoint(tmp_path, 1, state(1), {})
    (tmp_path / TRACKER).write_text("9\n")
    with pytest.raises(UserError, match="--load"):
        load_latest_checkpoint(tmp_path)


def test_a_garbage_tracker_is_a_user_error_naming_the_flag(tmp_path):
    save_checkpoint(tmp_path, 1, state(1), {})
    (tmp_path / TRACKER).write_text("garbage\n")
    with pytest.raises(UserError, match="--checkpoint .* holds 'garbage', not a rollout id") as info:
        load_latest_checkpoint(tmp_path, flag="--checkpoint")
    assert info.value.option == "--checkpoint"
