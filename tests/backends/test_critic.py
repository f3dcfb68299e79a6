"""The PPO critic on the torch backend: a second use of the RL step (`miles.train.step.train_critic`).

What is checked: the critic's values are read at the log-prob positions and its value loss trains it
towards the GAE returns; its gradient never reaches the actor (separate models, no shared storage,
the actor's weights untouched by a critic step and the critic's by an actor step); the actor's
advantages come from the values the critic returned; the critic's checkpoint restores it bit for
bit; DP=2 trains the critic exactly like DP=1 is checked by the e2e tests.
"""

from __future__ import annotations

import copy

import pytest
import torch
from backend_fixtures import make_engine_cfg, make_train_data

from miles.config.algo import AlgoConfig


def ppo_cfg(hf_dir, **kw):
    algo = AlgoConfig(advantage_estimator="ppo", value_clip=kw.pop("value_clip", 0.2))
    cfg = make_engine_cfg(hf_dir, algo=algo, micro_batch_size=kw.pop("micro_batch_size", 3), **kw)
    cfg.critic.critic_load = hf_dir
    cfg.critic.critic_lr = kw.get("lr", 1e-3) if "lr" in kw else 1e-2
    return cfg


def snapshot(module):
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def test_critic_learns_the_returns_and_its_gradient_never_reaches_the_actor(tiny_hf_dir):
    from miles.backends.torch import TorchBackend
    from miles.train.step import train_critic, train_rollout

    cfg = ppo_cfg(tiny_hf_dir)
    actor = TorchBackend(cfg, role="actor")
    critic = TorchBackend(cfg, role="critic")
    assert not critic.is_weight_source and critic.ref_net is None
    # Two models loaded from one directory share no storage, so no update of one can write the other.
    actor_ptrs = {p.data_ptr() for p in actor.model.parameters()}
    assert not actor_ptrs & {p.data_ptr() for p in critic.model.parameters()}
    data = make_train_data(12, seed=3)
    before_actor = snapshot(actor.model)
    losses = []
    for step in range(8):
        metrics, values = train_critic(critic, data, rollout_id=step)
        losses.append(metrics["critic/value_loss"])
        assert set(values) == set(range(12))
        assert all(values[i].shape == (data["response_lengths"][i],) and not values[i].requires_grad for i in values)
        for p in actor.model.parameters():
            assert p.grad is None
    after_actor = snapshot(actor.model)
    assert all(torch.equal(before_actor[k], after_actor[k]) for k in before_actor), "a critic step moved the actor"
    assert losses[-1] < 0.5 * losses[0], losses
    assert metrics["critic/lr"] == cfg.critic.critic_lr != cfg.optimizer.lr  # its own schedule
    for key in ("critic/value_loss", "critic/value_clipfrac", "critic/explained_variance", "critic/value_mean", "critic/grad_norm", "critic/lr"):
        assert key in metrics, key
    # The actor's step with the critic's values touches no critic weight either.
    before_critic = snapshot(critic.model)
    m = train_rollout(actor, data, rollout_id=0, values=values)
    assert m["train/grad_norm"] > 0
    assert all(torch.equal(before_critic[k], v) for k, v in snapshot(critic.model).items()), "an actor step moved the critic"


def test_actor_advantages_are_gae_over_the_critics_values(tiny_hf_dir):
    """The actor's advantages are exactly GAE (gamma, lambd) over the values `train_critic` returned."""
    from miles.backends.torch import TorchBackend
    from miles.train.inputs import fill_policy_inputs
    from miles.train.packing import pack_samples

    cfg = ppo_cfg(tiny_hf_dir)
    cfg.algo.gamma, cfg.algo.lambd = 0.9, 0.8
    actor = TorchBackend(cfg, role="actor")
    data = make_train_data(4, seed=5)
    batch = pack_samples(data, [0, 1, 2, 3], "cpu")
    values = {i: torch.linspace(-0.5, 0.5, data["response_lengths"][i]) for i in range(4)}
    fill_policy_inputs(actor, data, [0, 1, 2, 3], [batch], num_steps=1, values=values)
    start = 0
    for i in range(4):
        n = data["response_lengths"][i]
        mask, v, adv = data["loss_masks"][i], values[i].tolist(), batch.advantages[start : start + n].tolist()
        trained = [t for t in range(n) if mask[t]]
        expect, last = {}, 0.0
        for k in reversed(range(len(trained))):
            t = trained[k]
            next_v = v[trained[k + 1]] if k + 1 < len(trained) else 0.0
            r = data["rewards"][i] if k == len(trained) - 1 else 0.0
            last = r + 0.9 * next_v - v[t] + 0.9 * 0.8 * last
            expect[t] = last
        for t in range(n):
            assert adv[t] == pytest.approx(expect.get(t, 0.0), abs=1e-6), (i, t)
        start += n
    with pytest.raises(NotImplementedError, match="not a critic"):
        fill_policy_inputs(actor, data, [0, 1, 2, 3], [pack_samples(data, [0, 1, 2, 3], "cpu")], num_steps=1)


def test_critic_checkpoint_restores_it_bit_for_bit(tiny_hf_dir, tmp_path):
    from miles.backends.torch import TorchBackend
    from miles.train.step import train_critic

    cfg = ppo_cfg(tiny_hf_dir)
    data = make_train_data(6, seed=1)
    a = TorchBackend(cfg, role="critic")
    train_critic(a, data, rollout_id=0)
    a.save_checkpoint(str(tmp_path / "critic"))
    b = TorchBackend(cfg, role="critic")
    b.load_checkpoint(str(tmp_path / "critic"))
    ma, va = train_critic(a, data, rollout_id=1)
    mb, vb = train_critic(b, data, rollout_id=1)
    assert all(torch.equal(va[i], vb[i]) for i in va)
    assert ma["critic/value_loss"] == mb["critic/value_loss"]
    assert all(torch.equal(x, y) for x, y in zip(snapshot(a.model).values(), snapshot(b.model).values()))


def test_value_clip_is_around_the_values_before_the_rollouts_first_step(tiny_hf_dir):
    """Old values are the critic's before the rollout's first optimizer step: the first step sees
    V == V_old (nothing clipped), the second step's values have moved past --value-clip 0."""
    from miles.backends.torch import TorchBackend
    from miles.train.step import optimizer_step, train_critic

    cfg = ppo_cfg(tiny_hf_dir, value_clip=0.0, global_batch_size=3, num_steps_per_rollout=2)
    critic = TorchBackend(cfg, role="critic")
    data = make_train_data(6, seed=2)
    seen = []
    real = optimizer_step

    def spy(*a, **k):
        seen.append(real(*a, **k))
        return seen[-1]

    import miles.train.step as step

    step.optimizer_step = spy
    try:
        train_critic(critic, data, rollout_id=0)
    finally:
        step.optimizer_step = real
    assert seen[0]["critic/value_clipfrac"] == 0.0
    assert seen[1]["critic/value_clipfrac"] > 0.0
