"""Supported model families and the shape facts the mapping needs, read from a HF `config.json`.

What it is: `ModelShape.from_hf_config(config_dict)` picks the family from `architectures` and
collects every number the name/tensor mapping and the megatron-core layout depend on (layers, heads,
query groups, head dim, MLP sizes, experts, tied embeddings, qkv bias, qk-norm). Unknown architectures
and variants we cannot map faithfully raise `UserError` naming what is supported.

What it is not: a megatron-core `TransformerConfig` builder for training (see `megatron_config` for the
small subset the tests and the logits check need). Pure Python; no torch import.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from miles.errors import UserError

# HF architecture name -> family key. The family decides which tensor rules apply (see mapping.py).
ARCHITECTURES: dict[str, str] = {
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "LlamaForCausalLM": "llama",
    "Qwen3MoeForCausalLM": "qwen3_moe",
}


def supported_architectures() -> str:
    return ", ".join(sorted(ARCHITECTURES))


@dataclass(frozen=True)
class ModelShape:
    """Everything the mapping needs to know about one model (all sizes are global, i.e. TP=1)."""

    family: str
    architecture: str
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    head_dim: int
    ffn_hidden_size: int
    vocab_size: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_layernorm: bool
    norm_epsilon: float
    rotary_base: float
    num_experts: int = 0
    moe_ffn_hidden_size: int = 0
    moe_router_topk: int = 0
    moe_norm_topk_prob: bool = False
    shared_expert_ffn_hidden_size: int = 0
    shared_expert_gate: bool = False

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def heads_per_group(self) -> int:
        return self.num_attention_heads // self.num_query_groups

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any], *, source: str = "config.json") -> ModelShape:
        archs = cfg.get("architectures") or []
        arch = next((a for a in archs if a in ARCHITECTURES), None)
        if arch is None:
            raise UserError(
                f"{source}: architecture {archs or 'missing'} is not supported by miles convert; "
                f"supported: {supported_architectures()}."
            )
        family = ARCHITECTURES[arch]
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        groups = int(cfg.get("num_key_value_heads") or heads)
        head_dim = int(cfg.get("head_dim") or hidden // heads)
        rope = cfg.get("rope_parameters") or {}
        rotary_base = float(cfg.get("rope_theta") or rope.get("rope_theta") or 10000.0)
        unsupported = []
        if family == "llama" and cfg.get("mlp_bias"):
            unsupported.append("mlp_bias=true")
        if rope.get("rope_type", "default") not in ("default", None) or cfg.get("rope_scaling"):
            # The tensors convert fine, but the megatron side must then be told the scaling; flag it
            # instead of producing a checkpoint whose logits silently differ.
            unsupported.append(f"rope scaling {rope.get('rope_type') or cfg.get('rope_scaling')}")
        if heads % groups:
            unsupported.append(f"num_attention_heads={heads} not divisible by num_key_value_heads={groups}")
        moe: dict[str, Any] = {}
        if family == "qwen3_moe":
            if cfg.get("mlp_only_layers") or int(cfg.get("decoder_sparse_step", 1)) != 1:
                unsupported.append("dense layers mixed into the MoE stack (mlp_only_layers / decoder_sparse_step)")
            moe = dict(
                num_experts=int(cfg.get("num_experts") or cfg["num_local_experts"]),  # transformers 5 renamed it
                moe_ffn_hidden_size=int(cfg["moe_intermediate_size"]),
                moe_router_topk=int(cfg["num_experts_per_tok"]),
                moe_norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
                shared_expert_ffn_hidden_size=int(cfg.get("shared_expert_intermediate_size") or 0),
                shared_expert_gate=bool(cfg.get("shared_expert_intermediate_size")),
            )
        if unsupported:
            raise UserError(f"{source}: {arch} with {'; '.join(unsupported)} is not supported by miles convert.")
        return cls(
            family=family,
            architecture=arch,
            num_layers=int(cfg["num_hidden_layers"]),
            hidden_size=hidden,
            num_attention_heads=heads,
            num_query_groups=groups,
            head_dim=head_dim,
            ffn_hidden_size=int(cfg.get("intermediate_size") or 0),
            vocab_size=int(cfg["vocab_size"]),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=family == "qwen2" or bool(cfg.get("attention_bias", False)),
            qk_layernorm=family in ("qwen3", "qwen3_moe"),
            norm_epsilon=float(cfg.get("rms_norm_eps", 1e-6)),
            rotary_base=rotary_base,
            **moe,
        )

    def megatron_args(self) -> dict[str, Any]:
        """The megatron-core argument values this model implies (names as megatron's flags)."""
        args: dict[str, Any] = {
            "num_layers": self.num_layers,
            "hidden_size": self.hidden_size,
            "num_attention_heads": self.num_attention_heads,
            "num_query_groups": self.num_query_groups,
            "kv_channels": self.head_dim,
            "ffn_hidden_size": self.ffn_hidden_size,
            "untie_embeddings_and_output_weights": not self.tie_word_embeddings,
            "norm_epsilon": self.norm_epsilon,
            "rotary_base": self.rotary_base,
            "add_qkv_bias": self.qkv_bias,
            "qk_layernorm": self.qk_layernorm,
        }
        if self.is_moe:
            args.update(num_experts=self.num_experts, moe_ffn_hidden_size=self.moe_ffn_hidden_size,
                        moe_router_topk=self.moe_router_topk)
        return args


def validate_megatron_args(shape: ModelShape, requested: dict[str, Any], *, tensor_model_parallel_size: int = 1) -> None:
    """Raise one `UserError` listing every requested megatron arg that disagrees with the HF config.

    `requested` holds megatron flag names in snake_case (e.g. from a recipe); keys that are None or
    unknown to the converter are ignored. Divisibility by the tensor-parallel size is checked too.
    """
    implied = shape.megatron_args()
    problems = []
    for name, value in requested.items():
        if value is None or name not in implied:
            continue
        want = implied[name]
        same = abs(float(value) - float(want)) <= 1e-12 * max(1.0, abs(float(want))) if isinstance(want, float) else value == want
        if not same:
            problems.append(f"--{name.replace('_', '-')} {value} (HF config says {want})")
    tp = tensor_model_parallel_size
    for name in ("num_attention_heads", "num_query_groups", "ffn_hidden_size", "moe_ffn_hidden_size"):
        value = implied.get(name)
        if value and value % tp:
            problems.append(f"{name}={value} is not divisible by --tensor-model-parallel-size {tp}")
    if problems:
        raise UserError("The HF config and the requested Megatron arguments disagree: " + "; ".join(problems) + ".")
