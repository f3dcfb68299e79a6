"""TorchTrainer: gradient accumulation, determinism, resume, learning signal, metrics, weight export."""

from __future__ import annotations

import math

import pytest
import torch
from backend_fixtures import make_train_data

from miles.backends.torch import TorchTrainer
from miles.ckpt.trainer_checkpoint import load_latest_checkpoint, save_checkpoint
from miles.config.algo import AlgoConfig
from miles.config.optimizer import OptimizerConfig


def algo(**kw) -> AlgoConfig:
    kw.setdefault("eps_clip_high", kw.get("eps_clip", 0.2))  # resolve() fills it in a real run
    return AlgoConfig(**kw)


def make_trainer(hf_dir, *, micro_batch_size=2, algo_cfg=None, deterministic=True, **opt) -> TorchTrainer:
    opt.setdefault("lr", 1e-3)
    return TorchTrainer(
        hf_dir,
        optimizer_cfg=OptimizerConfig(**opt),
        algo_cfg=algo_cfg or algo(),
        micro_batch_size=micro_batch_size,
        deterministic=deterministic,
        seed=1234,
    )


def grads(trainer: TorchTrainer) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in trainer.model.named_parameters()}


def weights(trainer: TorchTrainer) -> dict[str, torch.Tensor]:
    return {n: t.detach().clone() for n, t in trainer.model.state_dict().items()}


def assert_bit_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("per_token", [False, True])
def test_gradient_accumulation_over_micro_batches_equals_one_big_batch(tiny_hf_dir, per_token):
    data = make_train_data(8, seed=1)
    cfg = algo(calculate_per_token_loss=per_token)
    small = make_trainer(tiny_hf_dir, micro_batch_size=1, algo_cfg=cfg, clip_grad=0.0)
    big = make_trainer(tiny_hf_dir, micro_batch_size=8, algo_cfg=cfg, clip_grad=0.0)
    m_small = small.train_step(data, rollout_id=0)
    m_big = big.train_step(data, rollout_id=0)
    g_small, g_big = grads(small), grads(big)
    worst = max((g_small[k] - g_big[k]).abs().max().item() for k in g_small)
    assert worst <= 1e-6, worst
    assert max(g.abs().max().item() for g in g_big.values()) > 1e-4  # the comparison is not between zeros
    for key in ("train/loss", "train/pg_loss", "train/entropy_loss", "train/grad_norm"):
        assert m_small[key] == pytest.approx(m_big[key], rel=1e-5, abs=1e-7), key


def test_grad_norm_is_the_l2_norm_and_clipping_bounds_it(tiny_hf_dir):
    data = make_train_data(4, seed=2)
    unclipped = make_trainer(tiny_hf_dir, clip_grad=0.0)
    m = unclipped.train_step(data, rollout_id=0)
    by_hand = math.sqrt(sum(float(g.double().square().sum()) for g in grads(unclipped).values()))
    assert m["train/grad_norm"] == pytest.approx(by_hand, rel=1e-5)

    clipped = make_trainer(tiny_hf_dir, clip_grad=by_hand / 4)
    m2 = clipped.train_step(data, rollout_id=0)
    assert m2["train/grad_norm"] == pytest.approx(by_hand, rel=1e-5)  # reported before clipping
    after = math.sqrt(sum(float(g.double().square().sum()) for g in grads(clipped).values()))
    assert after == pytest.approx(by_hand / 4, rel=1e-4)


def test_first_on_policy_step_has_ratio_one_and_rollout_logprobs_replace_it(tiny_hf_dir):
    data = make_train_data(6, seed=3, with_rollout_log_probs=True)
    m = make_trainer(tiny_hf_dir, micro_batch_size=4).train_step(data, rollout_id=0)
    # old log-probs come from the same micro-batches as the training forward: identical numbers
    assert m["train/ppo_kl"] == 0.0 and m["train/pg_clipfrac"] == 0.0
    assert m["train/train_rollout_logprob_abs_diff"] > 0.1  # the fake rollout log-probs are far off

    trainer = make_trainer(tiny_hf_dir, micro_batch_size=4, algo_cfg=algo(use_rollout_logprobs=True))
    with torch.no_grad():
        current = trainer.compute_log_probs(data)
    m_roll = trainer.train_step(data, rollout_id=0)
    masks = [torch.tensor(x, dtype=torch.float32) for x in data["loss_masks"]]
    expected = sum(
        float(((torch.tensor(r) - c) * mk).sum() / mk.sum())
        for r, c, mk in zip(data["rollout_log_probs"], current, masks)
    ) / len(masks)
    assert m_roll["train/ppo_kl"] == pytest.approx(expected, rel=1e-5)


def test_policy_step_raises_rewarded_and_lowers_punished_responses(tiny_hf_dir):
    data = make_train_data(4, seed=4)
    data["rewards"] = [1.0, -1.0, 1.0, -1.0]
    trainer = make_trainer(tiny_hf_dir, lr=1e-2)
    before = trainer.compute_log_probs(data)
    trainer.train_step(data, rollout_id=0)
    after = trainer.compute_log_probs(data)
    change = [float((a - b).sum()) for a, b in zip(after, before)]
    assert change[0] > 0 and change[2] > 0 and change[1] < 0 and change[3] < 0, change


def test_sft_loss_decreases(tiny_hf_dir):
    data = make_train_data(8, seed=5)
    trainer = make_trainer(tiny_hf_dir, micro_batch_size=4, algo_cfg=algo(loss_type="sft_loss"), lr=1e-2)
    losses = [trainer.train_step(data, rollout_id=i)["train/loss"] for i in range(15)]
    # a random model over 32 tokens starts near -log(1/32) = 3.47 nats per token
    assert 3.0 < losses[0] < 4.0
    assert losses[-1] < 0.6 * losses[0], losses
    assert set(trainer.train_step(data, rollout_id=15)) >= {"train/loss", "train/grad_norm", "train/lr"}


def test_metric_names_with_kl_loss_and_reference_model(tiny_hf_dir):
    data = make_train_data(8, seed=6)
    cfg = algo(use_kl_loss=True, kl_loss_coef=0.1, kl_loss_type="low_var_kl")
    trainer = make_trainer(tiny_hf_dir, algo_cfg=cfg, lr=1e-2)
    assert trainer.ref_model is not None
    first = trainer.train_step(data, rollout_id=0, global_batch_size=4, num_steps_per_rollout=2, n_samples_per_prompt=2)
    for name in ("loss", "pg_loss", "grad_norm", "lr", "pg_clipfrac", "ppo_kl", "kl_loss", "entropy_loss", "ratio_max"):
        assert f"train/{name}" in first, name
    assert first["train/kl_loss"] > 0  # the second step of the rollout already moved away from the reference
    second = trainer.train_step(data, rollout_id=1, global_batch_size=4, num_steps_per_rollout=2, n_samples_per_prompt=2)
    assert second["train/kl_loss"] > first["train/kl_loss"]
    with pytest.raises(RuntimeError, match="reference"):
        make_trainer(tiny_hf_dir).compute_log_probs(data, model="ref")


def test_lr_schedule_advances_once_per_optimizer_step(tiny_hf_dir):
    data = make_train_data(8, seed=7)
    trainer = make_trainer(tiny_hf_dir, lr=1.0e-3, lr_warmup_iters=4)
    m = trainer.train_step(data, rollout_id=0, global_batch_size=4, num_steps_per_rollout=2)
    assert m["train/lr"] == pytest.approx(5e-4)  # the second step of the warmup: 1e-3 * 2 / 4
    assert trainer.scheduler.num_steps == 2


def test_samples_need_not_form_whole_groups(tiny_hf_dir):
    # Group statistics are taken on the rollout side; the trainer's estimators work per sample, so a
    # rank holding part of a group (here 6 samples of groups of 4) trains (issue 9: it used to raise).
    m = make_trainer(tiny_hf_dir).train_step(make_train_data(6), rollout_id=0, n_samples_per_prompt=4)
    assert m["train/grad_norm"] > 0


def _run(trainer: TorchTrainer, rollouts: range) -> None:
    for r in rollouts:
        data = make_train_data(8, seed=100 + r)
        trainer.train_step(data, rollout_id=r, global_batch_size=4, num_steps_per_rollout=2, n_samples_per_prompt=2)


RESUME_OPT = dict(lr=1e-2, lr_warmup_iters=2, lr_decay_style="cosine", lr_decay_iters=8, min_lr=1e-4, weight_decay=0.1)
RESUME_ALGO = dict(use_kl_loss=True, kl_loss_coef=0.05, entropy_coef=0.01)


def test_two_deterministic_runs_are_bit_equal(tiny_hf_dir):
    runs = []
    for _ in range(2):
        t = make_trainer(tiny_hf_dir, algo_cfg=algo(**RESUME_ALGO), **RESUME_OPT)
        _run(t, range(3))
        runs.append(weights(t))
    assert_bit_equal(*runs)
    assert any(not torch.equal(runs[0][k], make_trainer(tiny_hf_dir).model.state_dict()[k]) for k in runs[0])


def test_resume_from_checkpoint_equals_uninterrupted_run_bit_for_bit(tiny_hf_dir, tmp_path):
    straight = make_trainer(tiny_hf_dir, algo_cfg=algo(**RESUME_ALGO), **RESUME_OPT)
    _run(straight, range(4))
    straight_rng = torch.rand(4)

    first = make_trainer(tiny_hf_dir, algo_cfg=algo(**RESUME_ALGO), **RESUME_OPT)
    _run(first, range(2))
    save_checkpoint(tmp_path, 1, first.state_dict(), {"next_rollout_id": 2})
    del first

    rollout_id, state, extra = load_latest_checkpoint(tmp_path)
    assert (rollout_id, extra) == (1, {"next_rollout_id": 2})
    resumed = make_trainer(tiny_hf_dir, algo_cfg=algo(**RESUME_ALGO), **RESUME_OPT)
    resumed.load_state_dict(state)
    _run(resumed, range(extra["next_rollout_id"], 4))

    assert_bit_equal(weights(resumed), weights(straight))
    s_opt, r_opt = straight.optimizer.state_dict()["state"], resumed.optimizer.state_dict()["state"]
    for k in s_opt:
        for name in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(s_opt[k][name], r_opt[k][name]), (k, name)
    assert resumed.scheduler.num_steps == straight.scheduler.num_steps == 8
    assert torch.equal(torch.rand(4), straight_rng)  # the RNG streams continue where they were


def test_named_weights_for_sync_are_hf_names_and_skip_tied_copies(tiny_hf_dir, tiny_tied_hf_dir):
    from safetensors.torch import load_file

    trainer = make_trainer(tiny_hf_dir)
    synced = dict(trainer.named_weights_for_sync())
    on_disk = load_file(f"{tiny_hf_dir}/model.safetensors")
    assert synced.keys() == on_disk.keys()
    assert all(torch.equal(synced[k], on_disk[k]) for k in synced)

    tied = dict(make_trainer(tiny_tied_hf_dir).named_weights_for_sync())
    assert "model.embed_tokens.weight" in tied and "lm_head.weight" not in tied


def test_data_parallel_needs_an_initialised_process_group(tiny_hf_dir):
    with pytest.raises(RuntimeError, match="torch.distributed"):
        TorchTrainer(
            tiny_hf_dir, optimizer_cfg=OptimizerConfig(), algo_cfg=algo(), micro_batch_size=1,
            deterministic=False, seed=0, dp_rank=0, dp_world_size=2,
        )


def test_single_step_rollouts_reuse_the_training_forward_as_old_log_probs(tiny_hf_dir):
    data = make_train_data(8, seed=9, with_rollout_log_probs=True)
    fast, slow = make_trainer(tiny_hf_dir), make_trainer(tiny_hf_dir)
    slow.reuse_on_policy_log_probs = False
    for r in range(2):
        m_fast, m_slow = fast.train_step(data, rollout_id=r), slow.train_step(data, rollout_id=r)
        assert {k: v for k, v in m_fast.items() if k.startswith("train/")} == {
            k: v for k, v in m_slow.items() if k.startswith("train/")
        }
    assert_bit_equal(weights(fast), weights(slow))
