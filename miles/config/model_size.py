"""Parameter counts of a decoder-only model from its Hugging Face `config.json` values (no weights read).

`ModelSize.from_hf_config(config)` counts, layer by layer, what the architecture holds: attention
(grouped-query, or DeepSeek-style multi-latent attention when `kv_lora_rank` is set), the dense MLP
(SwiGLU: three matrices), MoE layers (router, routed experts, shared experts; dense layers first when
`first_k_dense_replace` says so), norms, the embedding and the output head (once when tied). It keeps
routed-expert parameters apart from the rest, because the memory plan shards them differently
(expert parallelism) and only `num_experts_per_tok` of them are active per token.

What it is not: exact for architectures with extra pieces it does not model (DeepSeek-V4's
hyper-connections, compressors and indexer; multi-token-prediction layers), which it states in
`approximate`. Pure Python: `--dry-run` runs it without torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


def _get(cfg: dict[str, Any], *names: str, default: Any = None) -> Any:
    for n in names:
        if cfg.get(n) is not None:
            return cfg[n]
    return default


@dataclass(frozen=True)
class ModelSize:
    architecture: str
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    vocab_size: int
    attention_per_layer: int  # parameters of one layer's attention (incl. its norms)
    dense_mlp_per_layer: int  # one dense MLP
    moe_shared_per_layer: int  # router + shared experts of one MoE layer
    expert_params: int  # one routed expert
    num_experts: int
    experts_per_token: int
    num_dense_layers: int  # layers with a dense MLP (the rest are MoE when num_experts > 0)
    embedding: int  # input embedding
    output_head: int  # 0 when tied to the embedding
    final_norm: int
    kv_elements_per_token: int  # what an engine caches per token, all layers (K and V, or MLA's latent)
    ffn_hidden_size: int
    moe_ffn_hidden_size: int
    query_width: int  # heads x head dim of the queries
    kv_width: int  # key/value heads x head dim (MLA: the latent width)
    num_kv_heads: int = 0  # key/value heads (GQA); 0 under MLA, whose latent every engine TP rank caches whole
    weight_bytes: float = 2.0  # bytes per parameter of the checkpoint the engines load (bf16; FP8 checkpoints 1)
    approximate: str = ""  # what the count leaves out, when it is not exact
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def num_moe_layers(self) -> int:
        return self.num_layers - self.num_dense_layers if self.num_experts else 0

    @property
    def routed_expert_total(self) -> int:
        """All routed-expert parameters (what expert parallelism splits)."""
        return self.num_moe_layers * self.num_experts * self.expert_params

    @property
    def layer_total(self) -> int:
        """All transformer-layer parameters except routed experts."""
        dense = self.num_dense_layers if self.num_experts else self.num_layers
        return self.num_layers * self.attention_per_layer + dense * self.dense_mlp_per_layer + self.num_moe_layers * self.moe_shared_per_layer

    @property
    def total(self) -> int:
        return self.layer_total + self.routed_expert_total + self.embedding + self.output_head + self.final_norm

    @property
    def active(self) -> int:
        """Parameters one token passes through (the routed experts it is sent to, not all of them)."""
        active_experts = self.num_moe_layers * self.experts_per_token * self.expert_params
        return self.layer_total + active_experts + self.embedding + self.output_head + self.final_norm

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> "ModelSize":
        cfg = dict(cfg.get("text_config") or {}, **{k: v for k, v in cfg.items() if k != "text_config"})
        arch = (cfg.get("architectures") or ["unknown"])[0]
        h = int(cfg["hidden_size"])
        layers = int(_get(cfg, "num_hidden_layers", "num_layers"))
        heads = int(cfg["num_attention_heads"])
        vocab = int(cfg["vocab_size"])
        kv_heads = int(_get(cfg, "num_key_value_heads", default=heads))
        head_dim = int(_get(cfg, "head_dim", default=h // heads))
        ffn = int(_get(cfg, "intermediate_size", "ffn_hidden_size", default=4 * h))
        norm = h  # RMSNorm weight
        notes: list[str] = []
        if cfg.get("kv_lora_rank"):  # multi-latent attention (DeepSeek-V2/V3, Kimi-K2, GLM-4.7-Flash)
            q_rank = int(cfg.get("q_lora_rank") or 0)
            kv_rank = int(cfg["kv_lora_rank"])
            rope = int(cfg["qk_rope_head_dim"])
            nope = int(_get(cfg, "qk_nope_head_dim", default=head_dim - rope))
            v_dim = int(_get(cfg, "v_head_dim", default=head_dim))
            q = (h * q_rank + q_rank + q_rank * heads * (nope + rope)) if q_rank else h * heads * (nope + rope)
            kv = h * (kv_rank + rope) + kv_rank + kv_rank * heads * (nope + v_dim)
            attention = q + kv + heads * v_dim * h + norm
            query_width, kv_width = heads * (nope + rope), kv_rank + rope
            kv_cache = layers * (kv_rank + rope)  # the engine caches the compressed latent and the rope key
        else:
            q, kvw = heads * head_dim, kv_heads * head_dim
            attention = h * q + 2 * h * kvw + q * h + norm
            if cfg.get("attention_bias") or arch.startswith("Qwen2"):
                attention += q + 2 * kvw
            if arch.startswith("Qwen3"):
                attention += 2 * head_dim  # q_norm, k_norm
            query_width, kv_width = q, kvw
            kv_cache = layers * 2 * kvw
        dense_mlp = 3 * h * ffn + norm
        experts = int(_get(cfg, "num_experts", "num_local_experts", "n_routed_experts", default=0) or 0)
        moe_ffn = int(_get(cfg, "moe_intermediate_size", default=0) or 0)
        topk = int(_get(cfg, "num_experts_per_tok", "moe_router_topk", default=0) or 0)
        expert = 3 * h * moe_ffn
        shared = 0
        dense_layers = layers
        if experts:
            shared_ffn = int(cfg.get("shared_expert_intermediate_size") or 0) or int(cfg.get("n_shared_experts") or 0) * moe_ffn
            shared = h * experts + 3 * h * shared_ffn + norm + (h if cfg.get("shared_expert_intermediate_size") else 0)
            dense_layers = int(cfg.get("first_k_dense_replace") or 0)
            if cfg.get("mlp_only_layers"):
                dense_layers = len(cfg["mlp_only_layers"])
        if cfg.get("num_nextn_predict_layers"):
            notes.append(f"{cfg['num_nextn_predict_layers']} multi-token-prediction layer(s) not counted")
        approximate = ""
        if arch.startswith("DeepseekV4") or cfg.get("model_type") == "deepseek_v4":
            approximate = "DeepSeek-V4's hyper-connections, KV compressors and indexer are not counted"
        tied = bool(cfg.get("tie_word_embeddings", False))
        quant = cfg.get("quantization_config") or {}
        weight_bytes = 1.0 if str(quant.get("quant_method", "")).lower() == "fp8" else 2.0
        return cls(
            architecture=arch, num_layers=layers, hidden_size=h, num_attention_heads=heads, vocab_size=vocab,
            attention_per_layer=attention, dense_mlp_per_layer=dense_mlp, moe_shared_per_layer=shared,
            expert_params=expert, num_experts=experts, experts_per_token=topk, num_dense_layers=dense_layers,
            embedding=vocab * h, output_head=0 if tied else vocab * h, final_norm=norm,
            kv_elements_per_token=kv_cache, ffn_hidden_size=ffn, moe_ffn_hidden_size=moe_ffn,
            query_width=query_width, kv_width=kv_width, num_kv_heads=0 if cfg.get("kv_lora_rank") else kv_heads, weight_bytes=weight_bytes, approximate=approximate,
            notes=tuple(notes),
        )


def read_config(path: str) -> dict[str, Any] | None:
    """`<path>/config.json` as a dict, or None when it is not there (yet)."""
    import json
    from pathlib import Path

    file = Path(path) / "config.json"
    if not file.is_file():
        return None
    return json.loads(file.read_text())
