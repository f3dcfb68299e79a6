"""miles/config/model_size.py: parameter counts from config.json numbers.

- exact against transformers' own models (Qwen3 dense, Qwen3-MoE, DeepSeek-V3-style MLA + MoE with a
  dense first layer), built tiny on CPU and counted with `numel()`;
- the tiny recipe's model counted by hand;
- the published sizes of the catalog's models (Qwen3-4B 4.0B; Qwen3-30B-A3B 30.5B total / 3.3B
  active; Kimi-K2 1.04T / 32B; GLM-4.7-Flash about 30B), from the recipes' own `hf_config`.
"""

from __future__ import annotations

import pytest

from miles.config.model_size import ModelSize
from recipes.catalog.models import GLM_47_FLASH, KIMI_K2, QWEN3_4B, QWEN3_30B_A3B


def _numel(model) -> int:
    return sum(p.numel() for p in model.parameters())


def _size(config, arch: str) -> ModelSize:
    return ModelSize.from_hf_config({**config.to_dict(), "architectures": [arch]})


def test_tiny_qwen3_counted_by_hand():
    vocab = 40
    cfg = {"architectures": ["Qwen3ForCausalLM"], "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
           "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 256, "vocab_size": vocab, "tie_word_embeddings": True}
    # one layer: q 64x64, k and v 64x32, o 64x64, q/k norms 16 each, two RMSNorms of 64, SwiGLU 3 x 64 x 256
    layer = 4096 + 2048 + 2048 + 4096 + 32 + 128 + 3 * 64 * 256
    assert layer == 61600
    m = ModelSize.from_hf_config(cfg)
    assert m.total == vocab * 64 + 2 * layer + 64  # tied head: the embedding once, plus the final norm
    assert m.active == m.total and m.routed_expert_total == 0
    assert m.kv_elements_per_token == 2 * 2 * 32  # layers x (K and V) x kv heads x head dim


def test_exact_against_transformers_models():
    from transformers import (DeepseekV3Config, DeepseekV3ForCausalLM, Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig,
                              Qwen3MoeForCausalLM)

    dense = Qwen3Config(vocab_size=40, hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=16, tie_word_embeddings=True)
    assert _size(dense, "Qwen3ForCausalLM").total == _numel(Qwen3ForCausalLM(dense))
    moe = Qwen3MoeConfig(vocab_size=40, hidden_size=64, intermediate_size=256, moe_intermediate_size=32, num_experts=4,
                         num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    assert _size(moe, "Qwen3MoeForCausalLM").total == _numel(Qwen3MoeForCausalLM(moe))
    mla = DeepseekV3Config(vocab_size=40, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, n_routed_experts=4,
                           n_shared_experts=1, num_experts_per_tok=2, num_hidden_layers=3, first_k_dense_replace=1,
                           num_attention_heads=4, num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=16, qk_rope_head_dim=8,
                           qk_nope_head_dim=16, v_head_dim=16, n_group=1, topk_group=1)
    m = _size(mla, "DeepseekV3ForCausalLM")
    assert m.total == _numel(DeepseekV3ForCausalLM(mla))
    assert m.num_dense_layers == 1 and m.num_moe_layers == 2
    assert m.routed_expert_total == 2 * 4 * 3 * 64 * 32


@pytest.mark.parametrize("config, total, active", [
    (QWEN3_4B, 4.02e9, 4.02e9),       # Qwen/Qwen3-4B: 4.0B (3.6B without embeddings)
    (QWEN3_30B_A3B, 30.5e9, 3.3e9),   # Qwen/Qwen3-30B-A3B: 30.5B total, 3.3B activated
    (KIMI_K2, 1.04e12, 32e9),         # moonshotai/Kimi-K2-Instruct: 1T total, 32B activated (MTP not counted)
    (GLM_47_FLASH, 30e9, 3.5e9),      # zai-org/GLM-4.7-Flash: 30B-A3B class (MTP layer not counted)
])
def test_published_sizes_of_the_catalog_models(config, total, active):
    m = ModelSize.from_hf_config(config)
    assert m.total == pytest.approx(total, rel=0.03)
    assert m.active == pytest.approx(active, rel=0.1)


def test_qwen3_4b_exactly():
    m = ModelSize.from_hf_config(QWEN3_4B)
    # 36 layers x 100,930,816 + embedding 151936 x 2560 (tied) + final norm 2560
    assert m.total == 36 * 100_930_816 + 151936 * 2560 + 2560 == 4_022_468_096
