"""TorchBackend: gradient accumulation, determinism, per-rank checkpoint resume, learning signal,
temperature, metrics, weight buckets."""

from __future__ import annotations

import math

import pytest
import torch
from backend_fixtures import make_engine_cfg, make_train_data

from miles.backends.base import TrainerBackend
from miles.backends.torch import TorchBackend
from miles.config.algo import AlgoConfig
from miles.train.packing import pack_samples
from miles.train.step import train_rollout


def algo(**kw) -> AlgoConfig:
    kw.setdefault("eps_clip_high", kw.get("eps_clip", 0.2))  # resolve() fills it in a real run
    return AlgoConfig(**kw)


def make_trainer(hf_dir, **kw) -> TorchBackend:
    return TorchBackend(make_engine_cfg(hf_dir, **kw), rank=0, world_size=1, device="cpu")


def grads(trainer: TorchBackend) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in trainer.model.named_parameters()}


def weights(trainer: TorchBackend) -> dict[str, torch.Tensor]:
    return {n: t.detach().clone() for n, t in trainer.model.state_dict().items()}


def assert_bit_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def log_probs(trainer: TorchBackend, data: dict) -> list[torch.Tensor]:
    batch = pack_samples(data, range(len(data["tokens"])), "cpu")
    lp, _ = trainer.compute_log_probs(batch)
    return list(lp.split(data["response_lengths"]))


def test_it_is_a_trainer_backend(tiny_hf_dir):
    t = make_trainer(tiny_hf_dir)
    assert isinstance(t, TrainerBackend) and t.is_weight_source


@pytest.mark.parametrize("per_token", [False, True])
def test_gradient_accumulation_over_micro_batches_equals_one_big_batch(tiny_hf_dir, per_token):
    data = make_train_data(8, seed=1)
    cfg = algo(calculate_per_token_loss=per_token)
    small = make_trainer(tiny_hf_dir, micro_batch_size=1, algo=cfg, clip_grad=0.0)
    big = make_trainer(tiny_hf_dir, micro_batch_size=8, algo=cfg, clip_grad=0.0)
    m_small = train_rollout(small, data, rollout_id=0)
    m_big = train_rollout(big, data, rollout_id=0)
    g_small, g_big = grads(small), grads(big)
    worst = max((g_small[k] - g_big[k]).abs().max().item() for k in g_small)
    assert worst <= 1e-6, worst
    assert max(g.abs().max().item() for g in g_big.values()) > 1e-4  # the comparison is not between zeros
    for key in ("train/loss", "train/pg_loss", "train/entropy_loss", "train/grad_norm"):
        assert m_small[key] == pytest.approx(m_big[key], rel=1e-5, abs=1e-7), key


def test_grad_norm_is_the_l2_norm_and_clipping_bounds_it(tiny_hf_dir):
    data = make_train_data(4, seed=2)
    unclipped = make_trainer(tiny_hf_dir, clip_grad=0.0)
    m = train_rollout(unclipped, data, rollout_id=0)
    by_hand = math.sqrt(sum(float(g.double().square().sum()) for g in grads(unclipped).values()))
    assert m["train/grad_norm"] == pytest.approx(by_hand, rel=1e-5)

    clipped = make_trainer(tiny_hf_dir, clip_grad=by_hand / 4)
    m2 = train_rollout(clipped, data, rollout_id=0)
    assert m2["train/grad_norm"] == pytest.approx(by_hand, rel=1e-5)  # reported before clipping
    after = math.sqrt(sum(float(g.double().square().sum()) for g in grads(clipped).values()))
    assert after == pytest.approx(by_hand / 4, rel=1e-4)


def test_first_on_policy_step_has_ratio_one_and_rollout_logprobs_replace_it(tiny_hf_dir):
    data = make_train_data(6, seed=3, with_rollout_log_probs=True)
    m = train_rollout(make_trainer(tiny_hf_dir, micro_batch_size=4), data, rollout_id=0)
    # old log-probs come from the same micro-batches as the training forward: identical numbers
    assert m["train/ppo_kl"] == 0.0 and m["train/pg_clipfrac"] == 0.0
    assert m["train/train_rollout_logprob_abs_diff"] > 0.1  # the fake rollout log-probs are far off

    trainer = make_trainer(tiny_hf_dir, micro_batch_size=4, algo=algo(use_rollout_logprobs=True))
    current = log_probs(trainer, data)
    m_roll = train_rollout(trainer, data, rollout_id=0)
    masks = [torch.tensor(x, dtype=torch.float32) for x in data["loss_masks"]]
    expected = sum(
        float(((torch.tensor(r) - c) * mk).sum() / mk.sum())
        for r, c, mk in zip(data["rollout_log_probs"], current, masks)
    ) / len(masks)
    assert m_roll["train/ppo_kl"] == pytest.approx(expected, rel=1e-5)


def test_log_probs_are_taken_at_the_rollout_temperature(tiny_hf_dir):
    # The engine scores log_softmax(logits / T); the trainer must too, or the first on-policy ratio
    # against the engine's log-probs is off. By hand: log_softmax of the full-sequence logits / T.
    data = make_train_data(3, seed=11)
    trainer = make_trainer(tiny_hf_dir, temperature=0.6)
    lp = log_probs(trainer, data)
    for tokens, r, got in zip(data["tokens"], data["response_lengths"], lp):
        with torch.no_grad():
            logits = trainer.model(input_ids=torch.tensor([tokens])).logits[0].double()
        expected = torch.log_softmax(logits / 0.6, dim=-1)[torch.arange(len(tokens) - r - 1, len(tokens) - 1), tokens[-r:]]
        torch.testing.assert_close(got, expected.float(), rtol=0, atol=1e-5)


def test_policy_step_raises_rewarded_and_lowers_punished_responses(tiny_hf_dir):
    data = make_train_data(4, seed=4)
    data["rewards"] = [1.0, -1.0, 1.0, -1.0]
    trainer = make_trainer(tiny_hf_dir, lr=1e-2)
    before = log_probs(trainer, data)
    train_rollout(trainer, data, rollout_id=0)
    after = log_probs(trainer, data)
    change = [float((a - b).sum()) for a, b in zip(after, before)]
    assert change[0] > 0 and change[2] > 0 and change[1] < 0 and change[3] < 0, change


def test_sft_loss_decreases(tiny_hf_dir):
    data = make_train_data(8, seed=5)
    trainer = make_trainer(tiny_hf_dir, micro_batch_size=4, algo=algo(loss_type="sft_loss"), lr=1e-2)
    losses = [train_rollout(trainer, data, rollout_id=i)["train/loss"] for i in range(15)]
    # a random model over 32 tokens starts near -log(1/32) = 3.47 nats per token
    assert 3.0 < losses[0] < 4.0
    assert losses[-1] < 0.6 * losses[0], losses
    assert set(train_rollout(trainer, data, rollout_id=15)) >= {"train/loss", "train/grad_norm", "train/lr"}


def test_metric_names_with_kl_loss_and_reference_model(tiny_hf_dir):
    data = make_train_data(8, seed=6)
    cfg = algo(use_kl_loss=True, kl_loss_coef=0.1, kl_loss_type="low_var_kl")
    kw = dict(algo=cfg, lr=1e-2, global_batch_size=4, num_steps_per_rollout=2, n_samples_per_prompt=2)
    trainer = make_trainer(tiny_hf_dir, **kw)
    assert trainer.ref_model is not None
    first = train_rollout(trainer, data, rollout_id=0)
    for name in ("loss", "pg_loss", "grad_norm", "lr", "pg_clipfrac", "ppo_kl", "kl_loss", "entropy_loss", "ratio_max"):
        assert f"train/{name}" in first, name
    assert first["train/kl_loss"] > 0  # the second step of the rollout already moved away from the reference
    second = train_rollout(trainer, data, rollout_id=1)
    assert second["train/kl_loss"] > first["train/kl_loss"]
    with pytest.raises(RuntimeError, match="reference"):
        make_trainer(tiny_hf_dir).compute_log_probs(pack_samples(data, [0], "cpu"), model="ref")


def test_lr_schedule_advances_once_per_optimizer_step(tiny_hf_dir):
    data = make_train_data(8, seed=7)
    trainer = make_trainer(tiny_hf_dir, lr=1.0e-3, lr_warmup_iters=4, global_batch_size=4, num_steps_per_rollout=2)
    m = train_rollout(trainer, data, rollout_id=0)
    assert m["train/lr"] == pytest.approx(5e-4)  # the second step of the warmup: 1e-3 * 2 / 4
    assert trainer.num_optimizer_steps == 2
    assert all(g["lr"] == pytest.approx(5e-4) for g in trainer.optimizer.param_groups)  # every group got it


def test_samples_need_not_form_whole_groups(tiny_hf_dir):
    # Group statistics are taken on the rollout side; the trainer's estimators work per sample, so a
    # rank holding part of a group (here 6 samples of groups of 4) trains (issue 9: it used to raise).
    m = train_rollout(make_trainer(tiny_hf_dir, n_samples_per_prompt=4), make_train_data(6), rollout_id=0)
    assert m["train/grad_norm"] > 0


RESUME = dict(
    algo=algo(use_kl_loss=True, kl_loss_coef=0.05, entropy_coef=0.01, normalize_advantages=True),
    lr=1e-2, lr_warmup_iters=2, lr_decay_style="cosine", lr_decay_iters=8, min_lr=1e-4, weight_decay=0.1,
    global_batch_size=4, num_steps_per_rollout=2, n_samples_per_prompt=2,
)


def _run(trainer: TorchBackend, rollouts: range) -> list[float]:
    losses = []
    for r in rollouts:
        losses.append(train_rollout(trainer, make_train_data(8, seed=100 + r), rollout_id=r)["train/loss"])
        torch.rand(r + 1)  # stands in for code that draws random numbers (dropout, sampling) during training
    return losses


def test_two_deterministic_runs_are_bit_equal(tiny_hf_dir):
    runs = []
    for _ in range(2):
        t = make_trainer(tiny_hf_dir, **RESUME)
        _run(t, range(3))
        runs.append(weights(t))
    assert_bit_equal(*runs)
    assert any(not torch.equal(runs[0][k], make_trainer(tiny_hf_dir).model.state_dict()[k]) for k in runs[0])


def test_resume_from_a_per_rank_checkpoint_equals_uninterrupted_run_bit_for_bit(tiny_hf_dir, tmp_path):
    straight = make_trainer(tiny_hf_dir, **RESUME)
    straight_losses = _run(straight, range(4))
    straight_rng = torch.rand(4)

    first = make_trainer(tiny_hf_dir, **RESUME)
    _run(first, range(2))
    # a warm state: Adam moments and the schedule have moved, the last gradients are non-zero
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in first.model.parameters())
    first.save_checkpoint(str(tmp_path / "ckpt"))
    torch.rand(7)  # the saving process keeps drawing; the checkpoint must not care
    del first
    assert (tmp_path / "ckpt" / ".metadata").is_file() and (tmp_path / "ckpt" / "__0_0.distcp").is_file()

    resumed = make_trainer(tiny_hf_dir, **RESUME)
    resumed.load_checkpoint(str(tmp_path / "ckpt"))
    resumed_losses = _run(resumed, range(2, 4))

    assert resumed_losses == straight_losses[2:]
    assert_bit_equal(weights(resumed), weights(straight))
    s_opt, r_opt = straight.optimizer.state_dict()["state"], resumed.optimizer.state_dict()["state"]
    for k in s_opt:
        for name in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(s_opt[k][name], r_opt[k][name]), (k, name)
    assert resumed.num_optimizer_steps == straight.num_optimizer_steps == 8
    assert torch.equal(torch.rand(4), straight_rng)  # the RNG streams continue where they were


def test_checkpoint_weights_read_without_a_model(tiny_hf_dir, tmp_path):
    from miles.backends.torch.checkpoint import read_model_weights

    t = make_trainer(tiny_hf_dir, lr=1e-2)
    train_rollout(t, make_train_data(4, seed=1), rollout_id=0)
    t.save_checkpoint(str(tmp_path))
    assert_bit_equal(read_model_weights(str(tmp_path)), weights(t))


def test_named_weights_and_buckets_are_hf_names_and_skip_tied_copies(tiny_hf_dir, tiny_tied_hf_dir):
    from safetensors.torch import load_file

    trainer = make_trainer(tiny_hf_dir)
    synced = dict(trainer.named_weights_for_sync())
    on_disk = load_file(f"{tiny_hf_dir}/model.safetensors")
    assert synced.keys() == on_disk.keys()
    assert all(torch.equal(synced[k], on_disk[k]) for k in synced)
    buckets = list(trainer.iter_weight_buckets(4096))
    assert len(buckets) > 1 and all(sum(t.numel() * 4 for _, t in b) <= 4096 or len(b) == 1 for b in buckets)
    assert [n for b in buckets for n, _ in b] == list(synced)

    tied = dict(make_trainer(tiny_tied_hf_dir).named_weights_for_sync())
    assert "model.embed_tokens.weight" in tied and "lm_head.weight" not in tied


def test_data_parallel_needs_an_initialised_process_group(tiny_hf_dir):
    with pytest.raises(RuntimeError, match="torch.distributed"):
        TorchBackend(make_engine_cfg(tiny_hf_dir), rank=0, world_size=2, device="cpu")


def test_single_step_rollouts_reuse_the_training_forward_as_old_log_probs(tiny_hf_dir):
    data = make_train_data(8, seed=9, with_rollout_log_probs=True)
    fast, slow = make_trainer(tiny_hf_dir), make_trainer(tiny_hf_dir)
    for r in range(2):
        m_fast = train_rollout(fast, data, rollout_id=r)
        m_slow = train_rollout(slow, data, rollout_id=r, reuse_on_policy_log_probs=False)
        assert {k: v for k, v in m_fast.items() if k.startswith("train/")} == {
            k: v for k, v in m_slow.items() if k.startswith("train/")
        }
    assert_bit_equal(weights(fast), weights(slow))


def test_two_steps_per_rollout_still_compute_old_log_probs_before_the_first_update(tiny_hf_dir):
    """The reuse above is only exact with one optimizer step: with two, step 2's old log-probs must be the
    pre-update policy's (a reuse would make its ratio exactly 1 and train on different numbers)."""
    data = make_train_data(8, seed=11, with_rollout_log_probs=True)
    kw = dict(global_batch_size=4, num_steps_per_rollout=2, lr=1e-2)
    default, separate = make_trainer(tiny_hf_dir, **kw), make_trainer(tiny_hf_dir, **kw)
    m_default = train_rollout(default, data, rollout_id=0)
    m_separate = train_rollout(separate, data, rollout_id=0, reuse_on_policy_log_probs=False)  # always the separate no-grad pass
    train = lambda m: {k: v for k, v in m.items() if k.startswith("train/")}  # noqa: E731
    assert train(m_default) == train(m_separate)
    assert_bit_equal(weights(default), weights(separate))
    assert m_default["train/ratio_max"] > 1.0 or m_default["train/ratio_min"] < 1.0  # step 2 is off-policy
