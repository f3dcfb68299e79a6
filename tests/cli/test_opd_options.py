"""On-policy distillation's bad inputs through the `miles` program: exit 2, one sentence naming the
option and the fix, no traceback (OPD without a teacher, a teacher of another vocabulary, OPD options
without --use-opd, the trainer-forwarded teacher on the megatron backend)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

CASES = [
    (["--use-opd"], "--use-opd needs --opd-type"),
    (["--use-opd", "--opd-type", "megatron"], "give --opd-teacher-load"),
    (["--use-opd", "--opd-type", "sglang"], "give --opd-teacher-urls"),
    (["--use-opd", "--opd-type", "sglang", "--opd-teacher-urls", "http://127.0.0.1:1", "--opd-teacher-load", "t"],
     "--opd-teacher-load is for --opd-type megatron"),
    (["--use-opd", "--opd-type", "megatron", "--opd-teacher-load", "t", "--opd-teacher-urls", "http://127.0.0.1:1"],
     "--opd-teacher-urls is for --opd-type sglang"),
    (["--use-opd", "--opd-type", "sglang", "--opd-teacher-urls", "default=http://127.0.0.1:1"], "is not a base URL"),
    (["--opd-teacher-load", "t"], "--opd-teacher-load configures on-policy distillation, which is off; add --use-opd"),
    (["--opd-teacher-urls", "http://127.0.0.1:1"], "--opd-teacher-urls configures on-policy distillation"),
    (["--opd-kl-coef", "0.5"], "--opd-kl-coef configures on-policy distillation"),
    (["--opd-type", "megatron"], "--opd-type configures on-policy distillation"),
    (["--use-opd", "--opd-type", "megatron", "--opd-teacher-load", "t", "--opd-kl-coef", "-1"], "--opd-kl-coef -1.0 must be >= 0"),
    (["--use-opd", "--opd-type", "megatron", "--opd-teacher-load", "t", "--train-backend", "megatron"],
     "cannot train yet: --opd-type megatron — the megatron backend loads no on-policy distillation teacher"),
]


def miles(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": "400", "NO_COLOR": "1"}
    return subprocess.run([sys.executable, "-m", "miles_cli.main", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


@pytest.fixture
def inputs(tmp_path) -> Path:
    """A student and a teacher model directory (config.json only: nothing loads them) and a prompt file."""
    for name, vocab in (("student", 100), ("teacher", 100), ("other", 64)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps({"vocab_size": vocab}))
    (tmp_path / "p.jsonl").write_text(json.dumps({"input": "1+1", "label": "2"}) + "\n")
    return tmp_path


@pytest.mark.parametrize("args, sentence", CASES, ids=lambda x: " ".join(x) if isinstance(x, list) else None)
def test_opd_misuse_exits_2_with_one_sentence(tmp_path, args, sentence):
    r = miles(["train", *args], tmp_path)
    assert r.returncode == 2, r.stdout[-800:] + r.stderr[-800:]
    assert sentence in r.stderr.replace("\n", " ") or sentence in r.stdout.replace("\n", " "), r.stderr[-1500:]
    assert "Traceback" not in r.stderr


def test_a_teacher_with_another_vocabulary_exits_2(inputs):
    base = ["train", "--hf-checkpoint", "student", "--prompt-data", "p.jsonl", "--use-opd", "--opd-type", "megatron"]
    r = miles([*base, "--opd-teacher-load", "other"], inputs)
    assert r.returncode == 2, r.stderr[-1500:]
    assert "--opd-teacher-load other has a vocabulary of 64 tokens but the student (--hf-checkpoint) has 100" in r.stderr.replace("\n", " ")
    assert "Traceback" not in r.stderr
    # The same vocabulary passes this check (the run then stops at the next missing input).
    r = miles([*base, "--opd-teacher-load", "teacher"], inputs)
    assert "vocabulary" not in r.stderr, r.stderr[-1500:]
    r = miles([*base, "--opd-teacher-load", "missing"], inputs)
    assert r.returncode == 2 and "--opd-teacher-load missing does not exist" in r.stderr.replace("\n", " "), r.stderr[-1500:]
