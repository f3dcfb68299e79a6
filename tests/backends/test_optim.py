"""The LR schedule against hand-computed values, and AdamW's parameter groups."""

from __future__ import annotations

import math

import pytest
import torch

from miles.backends.torch.optim import StepCounter, build_optimizer
from miles.config.optimizer import OptimizerConfig
from miles.errors import UserError
from miles.train.lr_schedule import lr_at


def test_warmup_is_linear_from_lr_over_iters_and_never_zero():
    cfg = OptimizerConfig(lr=1e-3, lr_warmup_iters=4)
    assert [lr_at(s, cfg) for s in range(6)] == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3, 1e-3], rel=1e-12)


def test_linear_decay_after_warmup_reaches_min_lr_at_decay_iters():
    cfg = OptimizerConfig(lr=1.0, min_lr=0.1, lr_decay_style="linear", lr_warmup_iters=2, lr_decay_iters=6)
    # steps 2..6 move from lr to min_lr: progress (s - 2) / 4
    expected = {0: 0.5, 1: 1.0, 2: 1.0, 3: 0.775, 4: 0.55, 5: 0.325, 6: 0.1, 10: 0.1}
    for step, lr in expected.items():
        assert lr_at(step, cfg) == pytest.approx(lr, abs=1e-12), step


def test_cosine_decay_values():
    cfg = OptimizerConfig(lr=1.0, min_lr=0.0, lr_decay_style="cosine", lr_decay_iters=4)
    assert lr_at(0, cfg) == 1.0
    assert lr_at(1, cfg) == pytest.approx(0.5 * (1 + math.cos(math.pi / 4)), abs=1e-15)  # 0.8536
    assert lr_at(2, cfg) == pytest.approx(0.5, abs=1e-15)
    assert lr_at(4, cfg) == pytest.approx(0.0, abs=1e-15)
    assert lr_at(9, cfg) == pytest.approx(0.0, abs=1e-15)


def test_decay_without_decay_iters_is_a_user_error():
    with pytest.raises(UserError, match="--lr-decay-iters"):
        lr_at(0, OptimizerConfig(lr_decay_style="linear"))


def test_weight_decay_skips_one_dimensional_params():
    torch.manual_seed(0)
    layer = torch.nn.Linear(3, 2)
    w0, b0 = layer.weight.detach().clone(), layer.bias.detach().clone()
    opt = build_optimizer(layer, OptimizerConfig(lr=0.1, weight_decay=0.5))
    for p in layer.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    # zero gradient: Adam's update is 0, only the decoupled decay p *= 1 - lr * wd acts, on 2-D params only
    torch.testing.assert_close(layer.weight.detach(), w0 * (1 - 0.1 * 0.5), rtol=0, atol=1e-7)
    assert torch.equal(layer.bias.detach(), b0)


def test_step_counter_state_round_trip():
    steps = StepCounter()
    for _ in range(3):
        steps.advance()
    other = StepCounter()
    other.load_state_dict(steps.state_dict())
    assert other.num_steps == 3


def test_only_adam_is_available():
    with pytest.raises(UserError, match="--optimizer"):
        build_optimizer(torch.nn.Linear(2, 2), OptimizerConfig(optimizer="sgd"))  # type: ignore[arg-type]
