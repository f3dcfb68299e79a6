"""`miles full-train --use-opd` through the real CLI: a teacher prepared by `miles.prepare.opd_teacher`
(the warm start trained further), forwarded by the trainer (`--opd-type megatron` on the torch
backend); `train/opd_reverse_kl` logged every rollout; the checkpoint holds the student alone; a kill
+ rerun resumes bit for bit like an uninterrupted run.

Slow: three debug_minimal runs from the cached warm start (about 2 minutes each on 2 cores under load).
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest
import torch

from tests.e2e.test_full_train_ppo import dcp_state, latest, rows, run, warm
from tests.e2e.kill import sigkill_once_exists


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
    sigkill_once_exists(args, tmp_path, ckpt / "iter_0000001", timeout=600)
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


@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_opd_from_a_teacher_engine_scores_like_the_trainers_teacher(tmp_path, warm_start):
    """`--opd-type sglang` with the teacher behind the built-in engine server (a subprocess, on the CPU):
    the first rollout (same seed, same student, so the same samples) logs the same reverse KL as
    `--opd-type megatron` with the same teacher, to the attention kernels' rounding."""
    import re
    import sys

    from miles.prepare.opd_teacher import opd_teacher

    teacher = opd_teacher(warm_start=str(warm_start.sft_model), data=str(warm_start.train), out_dir=str(tmp_path / "teacher"), steps=20)
    log = tmp_path / "server.log"
    server = subprocess.Popen([sys.executable, "-m", "miles.rollout.engine.server", "--hf-checkpoint", str(teacher), "--port", "0"],
                              stdout=log.open("w"), stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 300
        while not re.search(r"http://127\.0\.0\.1:\d+", log.read_text()):
            assert server.poll() is None and time.monotonic() < deadline, log.read_text()[-2000:]
            time.sleep(0.2)
        url = re.search(r"http://127\.0\.0\.1:\d+", log.read_text()).group(0)
        common = ["full-train", "--mode", "debug_minimal", "--skip-eval-before-train", "--num-rollout", "1", "--use-opd"]
        run([*common, "--opd-type", "sglang", "--opd-teacher-urls", url, *warm(warm_start, tmp_path, "engine")], tmp_path)
    finally:
        server.terminate()
        server.wait(timeout=60)
    run([*common, "--opd-type", "megatron", "--opd-teacher-load", str(teacher), *warm(warm_start, tmp_path, "trainer")], tmp_path)
    engine, trainer = ([row for row in rows(tmp_path / "runs" / name) if "train/pg_loss" in row][0] for name in ("engine", "trainer"))
    assert "rollout/teacher_log_probs" in engine and engine["rollout/teacher_log_probs"] < 0
    assert engine["rollout/raw_reward"] == trainer["rollout/raw_reward"]  # the same samples
    assert engine["train/opd_reverse_kl"] != 0
    assert abs(engine["train/opd_reverse_kl"] - trainer["train/opd_reverse_kl"]) < 1e-4, (engine, trainer)
