"""On-policy distillation's engine teacher (`--opd-type sglang`): the built-in engine server scores a
sample's prompt tokens (SGLang's `logprob_start_len` / `input_token_logprobs`), and `TeacherScorer`
turns the answers into each sample's response-token log-probs: the same numbers the trainer's own
teacher forward gives (`--opd-type megatron`), at the rollout temperature. A teacher of another
vocabulary, or no engine at the URL, is a user error at start."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from miles.errors import UserError
from miles.prepare.tiny_model import create_tiny_qwen3
from miles.rollout.engine.builtin import BuiltinEngine
from miles.rollout.engine.server import EngineServer
from miles.rollout.opd_teacher import TeacherScorer

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("opd")
    return str(create_tiny_qwen3(root / "student", seed=0)), str(create_tiny_qwen3(root / "teacher", seed=3))


@pytest.fixture(scope="module")
def teacher_server(dirs):
    server = EngineServer(BuiltinEngine(dirs[1], seed=0))
    server.start()
    yield server
    server.stop()


TOKENS = [[5, 9, 12, 7, 3], [4, 4, 8, 10, 17, 18, 2]]  # the tiny tokenizer has 19 ids
RESPONSE_LENGTHS = [2, 4]


def test_engine_teacher_scores_like_the_trainers_teacher_forward(dirs, teacher_server):
    from miles.backends.torch import TorchBackend
    from miles.config.engine import EngineConfig
    from miles.train.packing import pack_samples

    scorer = TeacherScorer(teacher_server.url, student_dir=dirs[0], temperature=0.8)
    got = scorer.score(TOKENS, RESPONSE_LENGTHS)
    assert [len(x) for x in got] == RESPONSE_LENGTHS
    cfg = EngineConfig()
    cfg.rollout.hf_checkpoint, cfg.rollout.rollout_temperature = dirs[0], 0.8
    cfg.opd.use_opd, cfg.opd.opd_type, cfg.opd.opd_teacher_load = True, "megatron", dirs[1]
    data = {"tokens": TOKENS, "response_lengths": RESPONSE_LENGTHS, "loss_masks": [[1] * n for n in RESPONSE_LENGTHS], "rewards": [0.0, 0.0]}
    (expected, _), = TorchBackend(cfg).forward([pack_samples(data, [0, 1], "cpu")], model="teacher")
    # sdpa attention in the engine, eager in the trainer: the same model, a few ulps apart
    assert torch.allclose(torch.tensor(sum(got, [])), expected, atol=1e-5, rtol=0), (got, expected)
    # Scored at the temperature asked for: at 1.0 the numbers differ.
    at_one = TeacherScorer(teacher_server.url, student_dir=dirs[0], temperature=1.0).score(TOKENS, RESPONSE_LENGTHS)
    assert not torch.allclose(torch.tensor(sum(at_one, [])), expected, atol=1e-3)


def test_a_teacher_engine_with_another_vocabulary_is_refused(dirs, teacher_server, tmp_path):
    other = tmp_path / "student"
    shutil.copytree(dirs[0], other)
    config = json.loads((other / "config.json").read_text())
    config["vocab_size"] += 8
    (other / "config.json").write_text(json.dumps(config))
    with pytest.raises(UserError, match="whose vocabulary has .* tokens but the student") as e:
        TeacherScorer(teacher_server.url, student_dir=str(other), temperature=1.0)
    assert e.value.option == "--opd-teacher-urls"


def test_no_engine_at_the_url_is_a_user_error():
    from miles.utils.net import free_port

    with pytest.raises(UserError, match="did not answer /model_info"):
        TeacherScorer(f"http://127.0.0.1:{free_port()}", student_dir=None, temperature=1.0)
