"""LoRA on the torch backend (PEFT): only adapters train, the reference is the base with adapters off
(no second model), engines get merged HF-named weights, checkpoints hold the adapter and resume bit
for bit, and the parameter summary counts what trains."""

from __future__ import annotations

import json

import pytest
import torch
from backend_fixtures import make_engine_cfg, make_train_data

from miles.backends.torch import TorchBackend
from miles.config.algo import AlgoConfig
from miles.train.packing import pack_samples
from miles.train.step import train_rollout


def lora_cfg(hf_dir, *, rank=4, targets=("all-linear",), dropout=0.0, **kw):
    kw.setdefault("algo", AlgoConfig(use_kl_loss=True, kl_loss_coef=0.05, entropy_coef=0.01, eps_clip_high=0.2))
    cfg = make_engine_cfg(hf_dir, **kw)
    cfg.lora.lora_rank = rank
    cfg.lora.lora_alpha = 2 * rank
    cfg.lora.lora_dropout = dropout
    cfg.lora.target_modules = list(targets)
    return cfg


def lora_trainer(hf_dir, **kw) -> TorchBackend:
    return TorchBackend(lora_cfg(hf_dir, **kw), rank=0, world_size=1, device="cpu")


def adapter(t: TorchBackend) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in t.model.named_parameters() if p.requires_grad}


RESUME = dict(lr=1e-2, lr_warmup_iters=2, lr_decay_style="cosine", lr_decay_iters=8, min_lr=1e-4, weight_decay=0.1,
              global_batch_size=4, num_steps_per_rollout=2, n_samples_per_prompt=2)


def _run(t: TorchBackend, rollouts) -> list[float]:
    out = []
    for r in rollouts:
        out.append(train_rollout(t, make_train_data(8, seed=100 + r), rollout_id=r)["train/loss"])
        torch.rand(r + 1)
    return out


def test_only_adapter_parameters_reach_the_optimizer_and_the_base_stays_put(tiny_hf_dir):
    t = lora_trainer(tiny_hf_dir, lr=1e-2)
    opt_params = [p for g in t.optimizer.param_groups for p in g["params"]]
    names = {id(p): n for n, p in t.model.named_parameters()}
    assert opt_params and all("lora_" in names[id(p)] for p in opt_params)
    frozen = {n: p.detach().clone() for n, p in t.model.named_parameters() if not p.requires_grad}
    before = adapter(t)
    train_rollout(t, make_train_data(4, seed=1), rollout_id=0)
    after = adapter(t)
    assert any(not torch.equal(before[k], after[k]) for k in before), "the adapters never moved"
    for n, p in t.model.named_parameters():
        if not p.requires_grad:
            assert torch.equal(p, frozen[n]), n
    # all-linear: every attention and MLP projection of both layers, nothing else
    targets = {n.split(".lora_")[0].rsplit(".", 1)[-1] for n in after}
    assert targets == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}


def test_the_reference_is_the_base_with_adapters_off_and_no_second_model(tiny_hf_dir):
    from miles.train.step import train_rollout as step

    t = lora_trainer(tiny_hf_dir, lr=5e-2)
    assert t.ref_model is None and t.ref_net is None and t.has_reference
    step(t, make_train_data(4, seed=1), rollout_id=0)  # the adapter is no longer zero
    base = TorchBackend(make_engine_cfg(tiny_hf_dir), rank=0, world_size=1, device="cpu")
    batch = pack_samples(make_train_data(4, seed=2), range(4), "cpu")
    ref, _ = t.compute_log_probs(batch, model="ref")
    actor, _ = t.compute_log_probs(batch, model="actor")
    base_lp, _ = base.compute_log_probs(batch)
    assert torch.equal(ref, base_lp)
    assert not torch.allclose(actor, ref)
    # after the reference pass the adapters are on again
    assert torch.equal(t.compute_log_probs(batch)[0], actor)


def test_engines_get_merged_weights_under_the_base_names(tiny_hf_dir):
    from safetensors.torch import load_file

    t = lora_trainer(tiny_hf_dir, lr=5e-2)
    train_rollout(t, make_train_data(4, seed=1), rollout_id=0)
    synced = dict(t.named_weights_for_sync())
    on_disk = load_file(f"{tiny_hf_dir}/model.safetensors")
    assert synced.keys() == on_disk.keys()
    merged = t.peft.merge_and_unload(safe_merge=True)  # PEFT's own merge (mutates: last use of t)
    reference = merged.state_dict()
    changed = [k for k in synced if not torch.equal(synced[k], on_disk[k])]
    assert changed and all(k.endswith("proj.weight") for k in changed)
    for k in synced:
        torch.testing.assert_close(synced[k], reference[k], rtol=0, atol=1e-6)


def test_buckets_and_checksum_follow_the_merged_weights(tiny_hf_dir):
    t = lora_trainer(tiny_hf_dir, lr=5e-2)
    before = t.weights_checksum()
    train_rollout(t, make_train_data(4, seed=1), rollout_id=0)
    assert t.weights_checksum() != before
    names = [n for b in t.iter_weight_buckets(4096) for n, _ in b]
    assert names == [n for n, _ in t.named_weights_for_sync()] and not any("lora" in n or "base_layer" in n for n in names)


def test_lora_checkpoint_holds_only_the_adapter_and_resumes_bit_for_bit(tiny_hf_dir, tmp_path):
    from miles.backends.torch.checkpoint import saved_keys

    straight = lora_trainer(tiny_hf_dir, **RESUME)
    straight_losses = _run(straight, range(4))

    first = lora_trainer(tiny_hf_dir, **RESUME)
    _run(first, range(2))
    first.save_checkpoint(str(tmp_path / "ckpt"))
    torch.rand(7)
    del first
    keys = {k for k in saved_keys(str(tmp_path / "ckpt")) if k.startswith("model.")}
    assert keys and all(".lora_" in k for k in keys), sorted(keys)[:5]
    config = json.loads((tmp_path / "ckpt" / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8 and config["base_model_name_or_path"] == tiny_hf_dir

    resumed = lora_trainer(tiny_hf_dir, **RESUME)
    resumed.load_checkpoint(str(tmp_path / "ckpt"))
    assert _run(resumed, range(2, 4)) == straight_losses[2:]
    a, b = adapter(straight), adapter(resumed)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    s_opt, r_opt = straight.optimizer.state_dict()["state"], resumed.optimizer.state_dict()["state"]
    assert len(s_opt) == len(a)  # Adam moments for the adapters only
    for k in s_opt:
        for name in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(s_opt[k][name], r_opt[k][name]), (k, name)


def test_a_tied_head_is_not_in_the_adapter_checkpoint(tiny_tied_hf_dir, tmp_path):
    from miles.backends.torch.checkpoint import saved_keys

    t = lora_trainer(tiny_tied_hf_dir, lr=5e-2)
    train_rollout(t, make_train_data(4, seed=1), rollout_id=0)
    t.save_checkpoint(str(tmp_path / "ckpt"))
    keys = {k for k in saved_keys(str(tmp_path / "ckpt")) if k.startswith("model.")}
    assert keys and all(".lora_" in k for k in keys), sorted(k for k in keys if ".lora_" not in k)
    resumed = lora_trainer(tiny_tied_hf_dir, lr=5e-2)
    resumed.load_checkpoint(str(tmp_path / "ckpt"))
    a, b = adapter(t), adapter(resumed)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_full_checkpoint_does_not_load_into_a_lora_run_and_back(tiny_hf_dir, tmp_path):
    from miles.errors import UserError

    full = TorchBackend(make_engine_cfg(tiny_hf_dir), rank=0, world_size=1, device="cpu")
    full.save_checkpoint(str(tmp_path / "full"))
    with pytest.raises(UserError, match="holds full weights but this is a LoRA run"):
        lora_trainer(tiny_hf_dir).load_checkpoint(str(tmp_path / "full"))
    lora_trainer(tiny_hf_dir).save_checkpoint(str(tmp_path / "lora"))
    with pytest.raises(UserError, match="holds a LoRA adapter but this is full fine-tuning"):
        full.load_checkpoint(str(tmp_path / "lora"))


def test_parameter_summary_counts_the_adapters(tiny_hf_dir):
    t = lora_trainer(tiny_hf_dir, rank=4, targets=("q_proj", "v_proj"))
    s = t.parameter_metrics()
    # q_proj 32->32 and v_proj 32->16 in 2 layers, rank 4: A is 4x32, B is out x 4
    assert s["train/trainable_params"] == 2 * (4 * 32 + 32 * 4 + 4 * 32 + 16 * 4)
    assert s["train/trainable_share"] == pytest.approx(s["train/trainable_params"] / s["train/total_params"])
    assert s["train/optimizer_state_bytes"] == 8 * s["train/trainable_params"]
    train_rollout(t, make_train_data(4, seed=1), rollout_id=0)
    measured = t.parameter_metrics()["train/optimizer_state_bytes"]
    assert 8 * s["train/trainable_params"] <= measured <= 8 * s["train/trainable_params"] + 64 * 16  # + the step counters


def test_dropout_only_in_the_training_pass(tiny_hf_dir):
    t = lora_trainer(tiny_hf_dir, dropout=0.5, lr=5e-2)
    train_rollout(t, make_train_data(4, seed=1), rollout_id=0)
    batch = pack_samples(make_train_data(4, seed=2), range(4), "cpu")
    assert torch.equal(t.compute_log_probs(batch)[0], t.compute_log_probs(batch)[0])


def test_a_target_module_the_model_lacks_is_named(tiny_hf_dir):
    from miles.errors import UserError

    with pytest.raises(UserError, match="qkv_proj is not a linear layer of this model"):
        lora_trainer(tiny_hf_dir, targets=("qkv_proj",))


def test_start_from_a_peft_adapter(tiny_hf_dir, tmp_path):
    t = lora_trainer(tiny_hf_dir, lr=5e-2)
    train_rollout(t, make_train_data(4, seed=1), rollout_id=0)
    t.peft.save_pretrained(str(tmp_path / "adapter"))
    cfg = make_engine_cfg(tiny_hf_dir)
    cfg.lora.lora_adapter_path = str(tmp_path / "adapter")
    warm = TorchBackend(cfg, rank=0, world_size=1, device="cpu")
    a, b = adapter(t), adapter(warm)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert all(p.requires_grad for n, p in warm.model.named_parameters() if "lora_" in n)


def test_the_memory_plan_counts_the_adapters_the_trainer_builds(tiny_hf_dir):
    from miles.config.memory_plan import lora_parameters
    from miles.config.model_size import ModelSize, read_config

    for targets in (("all-linear",), ("q_proj", "v_proj"), ("gate_proj,down_proj",)):
        cfg = lora_cfg(tiny_hf_dir, rank=4, targets=targets)
        size = ModelSize.from_hf_config(read_config(tiny_hf_dir))
        t = TorchBackend(cfg, rank=0, world_size=1, device="cpu")
        assert lora_parameters(cfg, size) == t.parameter_metrics()["train/trainable_params"], targets
