"""On-policy distillation's trainer-forwarded teacher on the megatron trainer (gloo on this CPU): the
teacher is built with the student's layout, loaded from --opd-teacher-load, and the RL step with it
gives the torch trainer's numbers (`train/opd_reverse_kl`, the loss) on the same data over two
rollouts of two optimizer steps each (a teacher that moved, or the actor scored in its place, would
not)."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

import _mg_workers as _mp  # noqa: E402
from _mg_reference import make_train_data  # noqa: E402

warnings.filterwarnings("ignore")


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    from miles.prepare.tiny_model import create_tiny_qwen3

    root = tmp_path_factory.mktemp("opd")
    return str(create_tiny_qwen3(root / "student", seed=0)), str(create_tiny_qwen3(root / "teacher", seed=5))


def _config(student: str, teacher: str, backend: str) -> dict:
    return {"hf_checkpoint": student, "train_backend": backend, "global_batch_size": 4, "num_steps_per_rollout": 2,
            "micro_batch_size": 2, "n_samples_per_prompt": 2, "lr": 1e-2, "rollout_temperature": 0.8, "clip_grad": 1.0,
            "actor_num_gpus_per_node": 1, "use_opd": True, "opd_type": "megatron", "opd_teacher_load": teacher,
            "opd_kl_coef": 0.5}


def test_megatron_teacher_gives_the_torch_trainers_opd_numbers(dirs, tmp_path):
    from miles.backends.torch import TorchBackend
    from miles.config.resolve import build_config, fill_derived
    from miles.train.step import train_rollout

    student, teacher = dirs
    result = _mp.run(1, {"config": _config(student, teacher, "megatron"), "rollouts": [0, 1]}, tmp_path)
    torch_backend = TorchBackend(fill_derived(build_config(_config(student, teacher, "torch"))))
    expected = [train_rollout(torch_backend, make_train_data(8, seed=seed, vocab=19), rollout_id=k) for k, seed in enumerate([0, 1])]
    for got, want in zip(result["metrics"], expected):
        assert got["train/opd_reverse_kl"] != 0
        for key in ("train/opd_reverse_kl", "train/loss", "train/pg_loss"):
            assert abs(got[key] - want[key]) < 1e-5, (key, got[key], want[key])
