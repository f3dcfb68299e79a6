"""Tiny random Hugging Face models of every supported family (fp32), for the converter tests/bench.

`make_hf_model(family, directory, **overrides)` saves a model + a tiny tokenizer into `directory` and
returns the model. Shapes are chosen so that grouped-query attention has 2 groups of 2 heads (a plain
Q/K/V concatenation then differs from megatron's per-group interleaving).
"""

from __future__ import annotations

from pathlib import Path

import torch

FAMILIES = ("qwen2", "qwen3", "llama", "qwen3_moe")

_COMMON = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6)


def hf_config(family: str, **overrides):
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config, Qwen3MoeConfig

    kw = dict(_COMMON, **overrides)
    if family == "qwen2":
        return Qwen2Config(**kw)
    if family == "qwen3":
        return Qwen3Config(head_dim=8, **kw)
    if family == "llama":
        return LlamaConfig(**kw)
    if family == "qwen3_moe":
        return Qwen3MoeConfig(head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                              norm_topk_prob=True, **kw)
    raise ValueError(family)


def make_hf_model(family: str, directory: Path, *, seed: int = 0, **overrides):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config(family, **overrides), dtype=torch.float32)
    with torch.no_grad():
        # Random init leaves norms at 1 and biases at 0; perturb them so a swapped mapping shows.
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(directory)
    _write_tokenizer(directory)
    return model


def _write_tokenizer(directory: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {chr(ord("a") + i): i for i in range(26)} | {"<unk>": 26, "<eos>": 27}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>").save_pretrained(directory)
