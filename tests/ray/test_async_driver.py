"""The asynchronous driver modes in the real loop on the session's Ray: one-step overlap (--train-async)
trains one-update-old data and resumes from a checkpoint taken while the next rollout was under way
without losing or repeating a prompt; --fully-async runs, stays within its staleness bound and resumes."""

from __future__ import annotations

import json
import shutil

import pytest

from miles.ray.driver import run_training
from tests.ray.test_driver import config, files, metric_rows  # noqa: F401  (the module fixture)


def _prompts(run_dir, rollout_id: int) -> list[tuple[int, str]]:
    path = run_dir / "rollouts" / f"{rollout_id}.jsonl"
    return sorted((json.loads(x)["group_index"], json.loads(x)["prompt"]) for x in path.read_text().splitlines())


def _kill_after(run_dir, rollout_id: int) -> None:
    """What a SIGKILL right after rollout `rollout_id`'s checkpoint leaves: later checkpoints never happened."""
    ckpt = run_dir / "ckpt"
    for d in ckpt.glob("iter_*"):
        if int(d.name.removeprefix("iter_")) > rollout_id:
            shutil.rmtree(d)
    (ckpt / "latest_checkpointed_iteration.txt").write_text(f"{rollout_id}\n")


@pytest.mark.parametrize("mode", [{"train_async": True, "use_rollout_logprobs": True}, {"fully_async": True, "use_tis": True, "max_weight_staleness": 1}], ids=["train_async", "fully_async"])
def test_resume_during_async_training_neither_loses_nor_repeats_a_prompt(mode, files, tmp_path, ray_session):  # noqa: F811
    run_dir = tmp_path / "run"
    values = dict(colocate=False, num_rollout=4, save_interval=2, save_debug_rollout_data=str(run_dir / "rollouts" / "{rollout_id}.jsonl"), **mode)
    run_training(config(files, run_dir, **values), run_dir=run_dir, run_id="a")
    first = {r: _prompts(run_dir, r) for r in range(4)}
    rows = {r["step"]: r for r in metric_rows(run_dir) if "rollout/weight_staleness_max" in r}
    assert sorted(rows) == [1, 2, 3, 4]
    if "train_async" in mode:  # rollout k+1 was generated before step k's update: one update old
        assert [rows[s]["rollout/weight_staleness_max"] for s in (1, 2, 3, 4)] == [0.0, 1.0, 1.0, 1.0]
    else:
        assert max(r["rollout/weight_staleness_max"] for r in rows.values()) <= 1.0
    _kill_after(run_dir, 1)  # rollout 2 was under way when rollout 1's checkpoint was written
    # The checkpoint's data position: every group drawn so far is trained (rollouts 0, 1) or first in line.
    state = json.loads((run_dir / "ckpt" / "iter_0000001" / "extra.json").read_text())["rollout_manager"]["data_source"]
    waiting = [g[0]["group_index"] for g in state["buffer"]]
    done = [g for r in (0, 1) for g in {gi for gi, _ in first[r]}]
    assert sorted(done + waiting) == list(range(state["num_groups_handed_out"]))
    result = run_training(config(files, run_dir, **values), run_dir=run_dir, run_id="a")
    assert result.resumed_from == 1
    trained = [g for r in range(4) for g in {gi for gi, _ in _prompts(run_dir, r)}]
    assert len(trained) == len(set(trained)) == 16, "a prompt group was trained twice across the resume"
    if "train_async" in mode:  # the same prompts, in the same rollouts, as the uninterrupted run
        assert {r: _prompts(run_dir, r) for r in (2, 3)} == {r: first[r] for r in (2, 3)}
    else:  # the groups waiting at the checkpoint were generated again and trained first
        resumed = [g for r in (2, 3) for g in {gi for gi, _ in _prompts(run_dir, r)}]
        assert set(resumed) & set(waiting)
