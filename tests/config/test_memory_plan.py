"""miles/config/memory_plan.py: the per-GPU arithmetic, the fit check and the fixes it proposes.

Each number is checked against a hand computation on a small model (so a wrong factor, a missing
shard or a dropped term shows), and every fix the plan proposes is checked to really fit.
"""

from __future__ import annotations

import pytest

from miles.config.memory_plan import CUDA_CONTEXT, GiB, HARDWARE_MEMORY, plan_memory
from miles.config.model_size import ModelSize
from miles.config.resolve import build_config, resolve
from recipes.catalog.models import QWEN3_4B, QWEN3_30B_A3B

TINY = {"architectures": ["Qwen3ForCausalLM"], "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 256, "vocab_size": 40, "tie_word_embeddings": True}


def cfg(**values):
    base = {"prompt_data": "p.jsonl", "rollout_batch_size": 8, "n_samples_per_prompt": 8, "global_batch_size": 64,
            "num_rollout": 1, "actor_num_gpus_per_node": 8, "rollout_max_response_len": 100, "rollout_max_prompt_len": 28}
    return resolve(build_config({**base, **values}, environ={}))


def test_torch_ddp_fp32_holds_the_whole_model_with_adam():
    m = ModelSize.from_hf_config(TINY)
    p = plan_memory(cfg(), m, None)
    assert p.trainer["parameters"] == m.total * 4 and p.trainer["gradients"] == m.total * 4
    assert p.trainer["optimizer state"] == m.total * 8  # two fp32 moments
    # one micro-batch of one sample of 128 tokens; per token and layer: 4h + 2(q + kv widths) + 3f, plus 2 x heads x seq
    per_layer = 4 * 64 + 2 * 64 + 2 * 32 + 3 * 256 + 2 * 4 * 128
    assert p.trainer["activations"] == 128 * 2 * per_layer * 4
    assert p.trainer["logits"] == 128 * 40 * 8
    assert p.capacity is None and p.fits  # no GPU named: nothing to check against


def test_torch_bf16_keeps_fp32_master_parameters_and_counts_autocasts_bf16_copies():
    """--bf16 on the torch backend: the parameters stay fp32 and are the master weights (no extra copy
    in the optimizer); autocast holds a bf16 cast of every weight through a micro-batch's forward and
    backward (measured on CPU: 8 Linear 2048x2048, peak +62.5 MiB over fp32 for a 64 MiB bf16 copy).
    One worker: 4 + 4 + 8 + 2 = 18 bytes/param. DDP adds its fp32 gradient buckets: 22."""
    m = ModelSize.from_hf_config(TINY)
    n = m.total
    one = plan_memory(cfg(bf16=True, actor_num_gpus_per_node=1, global_batch_size=8), m, None).trainer
    assert (one["parameters"], one["gradients"], one["optimizer state"], one["bf16 weight copies"]) == (4 * n, 4 * n, 8 * n, 2 * n)
    assert "DDP gradient buckets" not in one
    ddp = plan_memory(cfg(bf16=True), m, None).trainer  # 8 workers
    assert ddp["DDP gradient buckets"] == 4 * n
    assert sum(ddp[k] for k in ("parameters", "gradients", "optimizer state", "bf16 weight copies", "DDP gradient buckets")) == 22 * n
    fp32 = plan_memory(cfg(actor_num_gpus_per_node=1, global_batch_size=8), m, None).trainer
    assert "bf16 weight copies" not in fp32 and fp32["parameters"] == 4 * n


def test_fsdp_shards_fp32_state_and_gathers_two_layers_and_the_root():
    m = ModelSize.from_hf_config(TINY)
    n, world = m.total, 8
    fsdp = plan_memory(cfg(train_backend="fsdp", bf16=True), m, None).trainer
    # fp32 shards of parameters and gradients (reduce-scattered in fp32) and Adam's two moments, 1/8 each
    assert (fsdp["parameters"], fsdp["gradients"], fsdp["optimizer state"]) == (int(n / world * 4), int(n / world * 4), int(n / world * 8))
    # unsharded in bf16: embedding (tied: no separate head) + final norm + two of the two layers
    assert fsdp["gathered weights"] == int((m.embedding + m.final_norm + 2 * m.layer_total / 2) * 2)
    assert plan_memory(cfg(train_backend="fsdp"), m, None).trainer["gathered weights"] == fsdp["gathered weights"] * 2  # fp32


def test_megatron_splits_layers_experts_and_the_optimizer():
    m = ModelSize.from_hf_config(QWEN3_30B_A3B)
    c = cfg(train_backend="megatron", tensor_model_parallel_size=4, expert_model_parallel_size=8, bf16=True,
            use_distributed_optimizer=True)
    p = plan_memory(c, m, "H100")
    dense = (m.layer_total + m.embedding + m.output_head + m.final_norm) / 4
    experts = m.routed_expert_total / 8
    assert p.trainer["parameters"] == int((dense + experts) * 2)
    assert p.trainer["gradients"] == int((dense + experts) * 4)
    # DP = 8 / TP4 = 2 for the dense part; expert DP = 8 / EP8 = 1
    assert p.trainer["optimizer state"] == int(12 * (dense / 2 + experts / 1))
    off = plan_memory(cfg(train_backend="megatron", tensor_model_parallel_size=4, expert_model_parallel_size=8, bf16=True,
                          optimizer_cpu_offload=True), m, "H100")
    assert off.trainer["optimizer state"] == 0


def test_recompute_and_flash_shrink_activations():
    m = ModelSize.from_hf_config(QWEN3_4B)
    base = dict(train_backend="megatron", tensor_model_parallel_size=2, bf16=True, rollout_max_response_len=4000)
    stored = plan_memory(cfg(**base), m, None).trainer["activations"]
    flash = plan_memory(cfg(**base, attention_backend="flash"), m, None).trainer["activations"]
    full = plan_memory(cfg(**base, attention_backend="flash", recompute_granularity="full", recompute_method="uniform",
                           recompute_num_layers=1), m, None).trainer["activations"]
    assert full < flash < stored
    # full recompute of single layers: each layer's input (h per token) + one layer rebuilt
    assert full == pytest.approx(4028 * (36 * 2560 + (4 * 2560 + (2 * 4096 + 2 * 1024 + 3 * 9728) / 2)) * 2, rel=1e-6)


def test_qwen3_30b_on_torch_does_not_fit_an_h100_and_every_fix_fits():
    m = ModelSize.from_hf_config(QWEN3_30B_A3B)
    c = cfg(rollout_max_response_len=8192, rollout_max_prompt_len=1024, colocate=True)
    p = plan_memory(c, m, "H100")
    assert not p.fits
    assert f"> {HARDWARE_MEMORY['H100'] / GiB:.1f} GiB" in p.problems[0]
    assert p.fixes and "together" in p.fixes[0]
    assert p.trainer["parameters"] == m.total * 4  # 30.5B fp32 weights on every GPU: 114 GiB alone


def test_a_proposed_single_fix_really_fits():
    m = ModelSize.from_hf_config(QWEN3_4B)
    c = cfg(train_backend="megatron", tensor_model_parallel_size=2, rollout_max_response_len=2000)
    hw = "H100"
    p = plan_memory(c, m, hw)
    if p.fits:  # make it too big first: fp32 on a smaller budget
        c = cfg(train_backend="megatron", tensor_model_parallel_size=1, rollout_max_response_len=8000, attention_backend="auto")
        p = plan_memory(c, m, hw)
    assert not p.fits and p.fixes
    from miles.config.memory_plan import _variants

    variants = dict(_variants(c, m))
    for fix in p.fixes:
        if fix in variants:
            assert plan_memory(variants[fix], m, hw, suggest=False).fits, fix


def test_engine_weights_must_fit_its_share():
    m = ModelSize.from_hf_config(QWEN3_30B_A3B)
    c = cfg(rollout_backend="sglang", rollout_num_gpus_per_engine=1, sglang_mem_fraction_static=0.5, train_backend="megatron",
            tensor_model_parallel_size=8, expert_model_parallel_size=8, bf16=True, optimizer_cpu_offload=True)
    p = plan_memory(c, m, "H100")
    assert p.engine["weights"] == int(m.total * 2)  # one GPU holds the whole bf16 checkpoint
    assert any("exceed its share" in x for x in p.problems)
    assert p.trainer["CUDA context"] == CUDA_CONTEXT


# The tiny Qwen3 by hand: attention 64·64 (q) + 2·64·32 (k, v) + 64·64 (o) + 64 (norm) + 2·16 (q/k norms)
# = 12,384; MLP 3·64·256 + 64 = 49,216; 2 layers = 123,200; tied embedding 40·64 = 2,560; final norm 64.
TINY_TOTAL = 125_824


def test_the_kl_reference_adds_frozen_parameters_with_the_actors_layout():
    m = ModelSize.from_hf_config(TINY)
    assert m.total == TINY_TOTAL
    assert "reference model" not in plan_memory(cfg(), m, None).trainer  # no KL term: no reference
    ddp = plan_memory(cfg(use_kl_loss=True), m, None)
    assert ddp.trainer["reference model"] == TINY_TOTAL * 4  # fp32, whole on every DDP rank
    # megatron --bf16 TP2: half the parameters per rank in bf16
    tp2 = plan_memory(cfg(use_kl_loss=True, train_backend="megatron", tensor_model_parallel_size=2, bf16=True), m, None)
    assert tp2.trainer["reference model"] == TINY_TOTAL // 2 * 2
    fsdp = plan_memory(cfg(use_kl_loss=True, train_backend="fsdp"), m, None)
    assert fsdp.trainer["reference model"] == TINY_TOTAL // 8 * 4  # 1/8 of fp32 shards
    # LoRA: the reference is the base with adapters off, no second copy
    lora = plan_memory(cfg(use_kl_loss=True, lora_rank=8, target_modules="all-linear"), m, None)
    assert "reference model" not in lora.trainer


def test_the_opd_teacher_counts_at_its_own_size_or_the_students():
    m = ModelSize.from_hf_config(TINY)
    # a 4-layer teacher: 4 · 61,600 + 2,560 + 64 = 249,024 parameters
    teacher = ModelSize.from_hf_config({**TINY, "num_hidden_layers": 4})
    assert teacher.total == 249_024
    opd = dict(use_opd=True, opd_type="megatron", opd_teacher_load="/teacher", train_backend="megatron",
               tensor_model_parallel_size=2, bf16=True)
    p = plan_memory(cfg(**opd), m, None, teacher=teacher)
    assert p.trainer["OPD teacher"] == 249_024 // 2 * 2  # TP2, bf16
    assert plan_memory(cfg(**opd), m, None).trainer["OPD teacher"] == TINY_TOTAL // 2 * 2  # unread: the student's size
    torch_fp32 = plan_memory(cfg(use_opd=True, opd_type="megatron", opd_teacher_load="/teacher"), m, None, teacher=teacher)
    assert torch_fp32.trainer["OPD teacher"] == 249_024 * 4
    # the sglang teacher lives in an engine elsewhere: nothing on the trainer's GPU
    remote = plan_memory(cfg(use_opd=True, opd_type="sglang", opd_teacher_urls=["http://t:1"]), m, None)
    assert "OPD teacher" not in remote.trainer


def test_the_ppo_critic_is_a_second_trained_model_unless_offload_makes_them_take_turns():
    m = ModelSize.from_hf_config(TINY)
    critic = TINY_TOTAL + 64 + 1  # the tied model's embedding stays, no LM head, a 64 -> 1 value head
    one = plan_memory(cfg(advantage_estimator="ppo", actor_num_gpus_per_node=1, global_batch_size=8), m, None)
    assert one.trainer["PPO critic"] == critic * (4 + 4 + 8)  # fp32 parameters, gradients, Adam's two moments
    ddp = plan_memory(cfg(advantage_estimator="ppo"), m, None)
    assert ddp.trainer["PPO critic"] == critic * (4 + 4 + 8 + 4)  # + DDP's fp32 gradient buckets
    # an untied model: the critic drops the 2,560-parameter head
    untied = ModelSize.from_hf_config({**TINY, "tie_word_embeddings": False})
    assert untied.total == TINY_TOTAL + 2560
    u = plan_memory(cfg(advantage_estimator="ppo", actor_num_gpus_per_node=1, global_batch_size=8), untied, None)
    assert u.trainer["PPO critic"] == critic * 16
    # megatron --bf16, distributed optimizer over DP 8: 2 + 4 bytes, (8 + 4) / 8 for Adam and the fp32 main copy
    mg = plan_memory(cfg(advantage_estimator="ppo", train_backend="megatron", bf16=True, use_distributed_optimizer=True), m, None)
    assert mg.trainer["PPO critic"] == int(critic * 2 + critic * 4 + critic * 12 / 8)
    off = plan_memory(cfg(advantage_estimator="ppo", offload_train=True, colocate=True), m, None)
    assert "PPO critic" not in off.trainer and any("takes turns" in d for d in off.details)


def test_megatron_keeps_each_tp_ranks_vocabulary_slice_of_the_logits():
    m = ModelSize.from_hf_config(TINY)
    # 128 tokens (one sample of 28 + 100) x 40 columns / TP 2 x (fp32 logits + fp32 log-softmax)
    tp2 = plan_memory(cfg(train_backend="megatron", tensor_model_parallel_size=2), m, None)
    assert tp2.trainer["logits"] == 128 * 40 // 2 * 8
    assert plan_memory(cfg(train_backend="megatron"), m, None).trainer["logits"] == 128 * 40 * 8
