"""`miles full-train --use-opd` through the real CLI: a teacher prepared by `miles.prepare.opd_teacher`
(the warm start trained further), forwarded by the trainer (`--opd-type megatron` on the torch
backend); `train/opd_reverse_kl` logged every rollout; the checkpoint holds the student alone; a kill
+ rerun resumes bit for bit like an uninterrupted run.

Slow: three debug_minimal runs from the cached warm start (about 2 minutes each on 2 cores under load).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from tests.e2e.test_full_train_ppo import MILES, dcp_state, latest, rows, run, warm


@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_opd_run_logs_the_reverse_kl_saves_no_teacher_and_resumes_bit_for_bit(tmp_path, warm_start):
    from miles.prepare.opd_teacher import opd_teacher

    teacher = opd_teacher(warm_start=str(warm_start.sft_model), data=str(warm_start.train), out_dir=str(tmp_path / "teacher"), steps=20)
    opd = ["--use-opd", "--opd-type", "megatron", "--opd-teacher-load", str(teacher), "--opd-kl-coef", "0.5"]
    common = ["full-train", "--mode", "debug_minimal", "--skip-eval-before-train", "--num-rollout", "4", *opd]
    run([*common, "--save-interval", "2", *warm(warm_start, tmp_path, "straight")], tmp_path)
    args = [*common, "--save-interval", "1", *warm(warm_start, tmp_path, "killed")]
    ckpt = tmp_path / "runs" / "killed" / "checkpoints"
    proc = subprocess.Popen(MILES + args, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 600
        while not (ckpt / "iter_0000001").exists():
            assert proc.poll() is None, "the run ended before its second checkpoint"
            assert time.monotonic() < deadline, "no checkpoint after 600 s"
            time.sleep(0.05)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
    r = run(args, tmp_path)
    assert "Resumed from" in r.stdout
    a_dir, b_dir = latest(tmp_path / "runs" / "straight"), latest(tmp_path / "runs" / "killed")
    assert a_dir.name == b_dir.name == "iter_0000003"
    a, b = dcp_state(a_dir), dcp_state(b_dir)
    assert a.keys() == b.keys() and a
    for k in a:
        assert torch.equal(a[k], b[k]), k
    # The student's weights and their Adam moments, nothing else: the teacher is never saved.
    from safetensors.torch import load_file

    student_names = set(load_file(str(next(Path(warm_start.sft_model).glob("*.safetensors")))))
    model_keys = {k.removeprefix("model.") for k in a if k.startswith("model.")}
    assert model_keys == student_names or model_keys <= student_names | {"lm_head.weight"}, sorted(model_keys ^ student_names)[:5]
    logged = [row for row in rows(tmp_path / "runs" / "straight") if "train/pg_loss" in row]
    assert len(logged) == 4 and all("train/opd_reverse_kl" in row for row in logged)
    assert any(row["train/opd_reverse_kl"] != 0 for row in logged)
    same = lambda name: [(row["train/opd_reverse_kl"], row["train/pg_loss"]) for row in rows(tmp_path / "runs" / name) if "train/pg_loss" in row]  # noqa: E731
    assert same("straight") == same("killed")
