"""On-policy distillation's trainer-forwarded teacher (`--use-opd --opd-type megatron`) on the torch backend.

Checked: the teacher's log-probs are exactly those of the teacher model scored as an actor; the
advantages are the estimator's minus --opd-kl-coef x (old student - teacher) on trained tokens only;
an RL step never gives the teacher a gradient, never moves it and never hands it to the optimizer;
the checkpoint holds the actor alone (the same entries, bytes and weights as a run without OPD);
`train/opd_reverse_kl` is reported.
"""

from __future__ import annotations

import pytest
import torch
from backend_fixtures import make_engine_cfg, make_tiny_hf_dir, make_train_data


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory) -> str:
    return make_tiny_hf_dir(tmp_path_factory.mktemp("tiny_teacher"), seed=7)


def opd_cfg(student, teacher, *, coef=0.5):
    cfg = make_engine_cfg(student, micro_batch_size=3, lr=1e-2)
    cfg.opd.use_opd, cfg.opd.opd_type, cfg.opd.opd_teacher_load, cfg.opd.opd_kl_coef = True, "megatron", teacher, coef
    return cfg


def test_teacher_log_probs_and_opd_advantages(tiny_hf_dir, teacher_dir):
    from miles.backends.torch import TorchBackend
    from miles.train.inputs import fill_policy_inputs
    from miles.train.packing import pack_samples

    data = make_train_data(6, seed=4)
    idx = list(range(6))
    actor = TorchBackend(opd_cfg(tiny_hf_dir, teacher_dir))
    assert actor.has_teacher and not actor.has_reference
    batch = pack_samples(data, idx, "cpu")
    fill_policy_inputs(actor, data, idx, [batch], num_steps=1)
    # The teacher's numbers are the teacher model's own, scored like an actor would score it.
    as_actor = TorchBackend(make_engine_cfg(teacher_dir, micro_batch_size=3))
    (expected_teacher, _), = as_actor.forward([pack_samples(data, idx, "cpu")])
    assert torch.equal(batch.teacher_log_probs, expected_teacher)
    (student, _), = actor.forward([pack_samples(data, idx, "cpu")])
    assert torch.equal(batch.old_log_probs, student)  # OPD needs the old log-probs before the advantages
    assert not torch.equal(student, expected_teacher)
    mask = batch.loss_mask
    rewards = torch.repeat_interleave(torch.tensor(data["rewards"]), batch.response_lengths)
    expected = (rewards - 0.5 * (student - expected_teacher)) * mask
    assert torch.allclose(batch.advantages, expected, atol=1e-6, rtol=0)
    assert (batch.advantages[mask == 0] == 0).all()


def test_the_teacher_gets_no_gradient_and_is_not_saved(tiny_hf_dir, teacher_dir, tmp_path):
    from miles.backends.torch import TorchBackend
    from miles.backends.torch.checkpoint import read_model_weights
    from miles.train.step import train_rollout

    data = make_train_data(6, seed=2)
    actor = TorchBackend(opd_cfg(tiny_hf_dir, teacher_dir))
    teacher = actor.teacher_net
    before = {k: v.detach().clone() for k, v in teacher.state_dict().items()}
    optimised = {id(p) for g in actor.optimizer.param_groups for p in g["params"]}
    assert not optimised & {id(p) for p in teacher.parameters()}
    assert not {p.data_ptr() for p in teacher.parameters()} & {p.data_ptr() for p in actor.model.parameters()}
    student_before = {k: v.detach().clone() for k, v in actor.model.state_dict().items()}
    for step in range(2):
        metrics = train_rollout(actor, data, rollout_id=step)
        assert all(p.grad is None and not p.requires_grad for p in teacher.parameters())
    assert metrics["train/grad_norm"] > 0 and "train/opd_reverse_kl" in metrics
    assert all(torch.equal(before[k], v) for k, v in teacher.state_dict().items()), "an RL step moved the teacher"
    assert any(not torch.equal(student_before[k], v) for k, v in actor.model.state_dict().items()), "the student did not train"

    actor.save_checkpoint(str(tmp_path / "opd"))
    plain = TorchBackend(make_engine_cfg(tiny_hf_dir, micro_batch_size=3, lr=1e-2))
    plain.save_checkpoint(str(tmp_path / "plain"))
    saved, reference = read_model_weights(str(tmp_path / "opd")), read_model_weights(str(tmp_path / "plain"))
    assert set(saved) == set(reference)  # the actor's names, nothing of the teacher's
    assert all(torch.equal(saved[k], v) for k, v in actor.model.state_dict().items() if k in saved)
    size = lambda d: sum(f.stat().st_size for f in d.iterdir())  # noqa: E731
    # The teacher's weights alone are ~80 kB; the two differ only in the pickled step count.
    assert abs(size(tmp_path / "opd") - size(tmp_path / "plain")) < 100


def test_opd_reverse_kl_metric_is_the_old_student_minus_teacher_mean(tiny_hf_dir, teacher_dir):
    """One rollout, one step, one micro-batch: the metric is the per-sample mean of student - teacher
    over trained tokens, averaged over samples, from the log-probs before the update."""
    from miles.backends.torch import TorchBackend
    from miles.train.packing import pack_samples
    from miles.train.step import train_rollout

    data = make_train_data(6, seed=9)
    idx = list(range(6))
    actor = TorchBackend(opd_cfg(tiny_hf_dir, teacher_dir))
    (student, _), = actor.forward([pack_samples(data, idx, "cpu")])
    (teacher, _), = actor.forward([pack_samples(data, idx, "cpu")], model="teacher")
    mask = pack_samples(data, idx, "cpu").loss_mask
    per_sample = [
        float(((s - t) * m).sum() / m.sum())
        for s, t, m in zip(student.split(data["response_lengths"]), teacher.split(data["response_lengths"]), mask.split(data["response_lengths"]))
    ]
    cfg = opd_cfg(tiny_hf_dir, teacher_dir)
    cfg.train.micro_batch_size = 6
    metrics = train_rollout(TorchBackend(cfg), data, rollout_id=0)
    assert abs(metrics["train/opd_reverse_kl"] - sum(per_sample) / 6) < 1e-6
