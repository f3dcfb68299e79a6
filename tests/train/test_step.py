"""The RL step against a fake backend: which primitives it calls, in which order, with what.

A fake `TrainerBackend` whose "policy" is one scalar (every response token's log-prob is `-w`) shows
that `train_rollout` drives any backend through the interface alone: forwards only where needed, the
critic hook for estimators that need values, the lr of the schedule, one optimizer step per step.
"""

from __future__ import annotations

import pytest
import torch

from miles.algo.advantages import ESTIMATORS, NEEDS_VALUES, estimator
from miles.backends.base import TrainerBackend
from miles.config.algo import AlgoConfig
from miles.config.engine import EngineConfig
from miles.train.lr_schedule import lr_at
from miles.train.step import train_rollout


class FakeBackend(TrainerBackend):
    def __init__(self, cfg, *, with_values: bool = False):
        self.cfg, self.device, self.is_weight_source = cfg, "cpu", True
        self.w = torch.nn.Parameter(torch.tensor(1.0))
        self.calls: list[tuple] = []
        self.steps = 0
        self.with_values = with_values

    dp_rank, dp_size = 0, 1
    has_reference = False
    num_optimizer_steps = property(lambda self: self.steps)

    def all_reduce_dp(self, t):
        return t

    def all_reduce_metrics(self, local):
        return local

    def forward(self, batches, *, model="actor", with_entropy=False):
        self.calls.append(("forward", model, len(batches)))
        return [(-self.w.detach() * torch.ones(int(b.response_lengths.sum())), None) for b in batches]

    def values(self, batches):
        if not self.with_values:
            return super().values(batches)
        self.calls.append(("values", len(batches)))
        return [torch.full((int(b.response_lengths.sum()),), 0.25) for b in batches]

    def forward_backward(self, batches, loss_fn, *, with_entropy, entropy_grad):
        self.calls.append(("forward_backward", len(batches)))
        self.w.grad = None
        for b in batches:
            lp = -self.w * torch.ones(int(b.response_lengths.sum()))
            loss_fn(b, lp, torch.zeros_like(lp) if with_entropy else None).backward()

    def optimizer_step(self, lr):
        self.calls.append(("optimizer_step", lr))
        with torch.no_grad():
            self.w -= lr * self.w.grad
        self.steps += 1
        return float(self.w.grad.abs()), True

    offload = onload = lambda self: None
    save_checkpoint = load_checkpoint = lambda self, d: None
    iter_weight_buckets = lambda self, n: iter(())
    weights_checksum = lambda self: ""


def make_cfg(*, steps: int = 1, **algo) -> EngineConfig:
    cfg = EngineConfig()
    cfg.algo = AlgoConfig(**algo)
    cfg.algo.eps_clip_high = cfg.algo.eps_clip
    cfg.data.global_batch_size = 4 // steps
    cfg.data.num_steps_per_rollout = steps
    cfg.train.micro_batch_size = 1
    cfg.optimizer.lr = 0.1
    cfg.optimizer.lr_warmup_iters = 4
    return cfg


def data(n: int = 4) -> dict:
    return {"tokens": [[1, 2, 3]] * n, "response_lengths": [2] * n, "loss_masks": [[1, 1]] * n,
            "rewards": [1.0, 0.5, -1.0, 0.0][:n]}


def test_one_step_reuses_the_training_forward_and_steps_at_the_schedules_lr():
    backend = FakeBackend(make_cfg())
    m = train_rollout(backend, data(), rollout_id=0)
    assert backend.calls == [("forward_backward", 4), ("optimizer_step", lr_at(0, backend.cfg.optimizer))]
    assert m["train/lr"] == pytest.approx(0.025) and m["train/skipped_step"] == 0.0
    assert m["train/ratio_max"] == 1.0  # old log-probs = the training forward's, detached


def test_two_steps_take_old_log_probs_before_the_first_update():
    backend = FakeBackend(make_cfg(steps=2))
    m = train_rollout(backend, data(), rollout_id=0)
    lrs = [lr_at(s, backend.cfg.optimizer) for s in range(2)]
    assert backend.calls == [("forward", "actor", 4), ("forward_backward", 2), ("optimizer_step", lrs[0]),
                             ("forward_backward", 2), ("optimizer_step", lrs[1])]
    assert m["train/ratio_max"] > 1.0 or m["train/ratio_min"] < 1.0  # step 2 is off-policy
    assert backend.num_optimizer_steps == 2


def test_separate_old_log_prob_forward_on_request():
    backend = FakeBackend(make_cfg())
    train_rollout(backend, data(), rollout_id=0, reuse_on_policy_log_probs=False)
    assert backend.calls[0] == ("forward", "actor", 4)


def test_sft_needs_no_policy_inputs():
    backend = FakeBackend(make_cfg(loss_type="sft_loss"))
    train_rollout(backend, data(), rollout_id=0)
    assert [c[0] for c in backend.calls] == ["forward_backward", "optimizer_step"]


@pytest.fixture
def value_estimator():
    """An estimator that reads the critic, registered here: its advantages are the values."""

    @estimator("values_for_test", needs_values=True)
    def from_values(cfg, *, rewards, kl, mask, segments, values):
        return values * mask, values * mask

    yield "values_for_test"
    ESTIMATORS.pop("values_for_test")
    NEEDS_VALUES.discard("values_for_test")


def test_an_estimator_that_needs_values_gets_the_backends_critic(value_estimator):
    backend = FakeBackend(make_cfg(advantage_estimator=value_estimator), with_values=True)
    m = train_rollout(backend, data(), rollout_id=0)
    assert ("values", 4) in backend.calls
    # every advantage is 0.25 > 0: the policy loss pushes all log-probs up, so w must fall
    assert backend.w.item() < 1.0 and m["train/pg_loss"] == pytest.approx(-0.25)


def test_a_backend_without_a_critic_says_so(value_estimator):
    backend = FakeBackend(make_cfg(advantage_estimator=value_estimator))
    with pytest.raises(NotImplementedError, match="critic"):
        train_rollout(backend, data(), rollout_id=0)
