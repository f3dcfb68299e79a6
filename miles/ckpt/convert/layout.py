"""Where each tensor lives: HF shapes from the config, and megatron-core's `torch_dist` sharded keys.

megatron-core does not store `decoder.layers.3.mlp.linear_fc1.weight` under that name: a GPTModel's
`sharded_state_dict()` stacks every layer's tensor into one global tensor with a leading layer axis
(`decoder.layers.mlp.linear_fc1.weight`, shape [num_layers, ...]), experts get a second axis
(`decoder.layers.mlp.experts.experts.linear_fc1.weight`, [num_layers, num_experts, ...]), and the local
spec files its norms under TransformerEngine's names (`input_layernorm` ->
`self_attention.linear_qkv.layer_norm_weight`). `sharded_key(name, shape)` reproduces that rule so a
converter can write exactly the keys a GPTModel will ask for; a test checks it against a real model.

What it is not: a store of shards for TP>1 writers: we always write whole (TP=1) tensors; megatron-core
reads any TP slicing out of them at load time.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from miles.ckpt.convert.families import ModelShape
from miles.ckpt.convert.mapping import Rule, rules_for

_EXPERT = re.compile(r"^decoder\.layers\.(\d+)\.mlp\.experts\.local_experts\.(\d+)\.(.+)$")
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
# The local spec keeps TE's checkpoint names for the two pre-norms (megatron-core's
# sharded_state_dict_keys_map), so a checkpoint loads under either spec.
_LAYER_KEY_MAP = {
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
}
_LINEAR_WITH_EXTRA_STATE = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")


@dataclass(frozen=True)
class ShardedKey:
    """A local tensor's place in a stacked global tensor: key + (axis, index, size) per prepended axis."""

    key: str
    prepend: tuple[tuple[int, int, int], ...]


def sharded_key(name: str, shape: ModelShape) -> ShardedKey:
    m = _EXPERT.match(name)
    if m:
        layer, expert, rest = int(m[1]), int(m[2]), m[3]
        return ShardedKey(f"decoder.layers.mlp.experts.experts.{rest}",
                          ((0, layer, shape.num_layers), (1, expert, shape.num_experts)))
    m = _LAYER.match(name)
    if m:
        layer, rest = int(m[1]), m[2]
        return ShardedKey(f"decoder.layers.{_LAYER_KEY_MAP.get(rest, rest)}", ((0, layer, shape.num_layers),))
    return ShardedKey(name, ())


def extra_state_keys(rules: list[Rule], shape: ModelShape) -> list[ShardedKey]:
    """The `_extra_state` objects a local-spec GPTModel expects (one per linear layer, value None)."""
    out = []
    for r in rules:
        module, _, param = r.megatron.rpartition(".")
        if param == "weight" and module.rsplit(".", 1)[-1] in _LINEAR_WITH_EXTRA_STATE and module.startswith("decoder.layers."):
            sk = sharded_key(r.megatron, shape)
            out.append(ShardedKey(sk.key.rsplit(".", 1)[0] + "._extra_state", sk.prepend))
    return out


def hf_shapes(shape: ModelShape) -> dict[str, tuple[int, ...]]:
    """The shape of every HF tensor the config implies (what a checkpoint must contain)."""
    h, d, v = shape.hidden_size, shape.head_dim, shape.vocab_size
    q, kv = shape.num_attention_heads * d, shape.num_query_groups * d
    suffix = {
        "input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,),
        "self_attn.q_proj.weight": (q, h), "self_attn.k_proj.weight": (kv, h), "self_attn.v_proj.weight": (kv, h),
        "self_attn.q_proj.bias": (q,), "self_attn.k_proj.bias": (kv,), "self_attn.v_proj.bias": (kv,),
        "self_attn.q_norm.weight": (d,), "self_attn.k_norm.weight": (d,), "self_attn.o_proj.weight": (h, q),
        "mlp.gate.weight": (shape.num_experts, h), "mlp.shared_expert_gate.weight": (1, h),
    }
    out: dict[str, tuple[int, ...]] = {}
    for r in rules_for(shape):
        for name in r.hf:
            if name in ("model.embed_tokens.weight", "lm_head.weight"):
                out[name] = (v, h)
            elif name == "model.norm.weight":
                out[name] = (h,)
            else:
                tail = name.split(".", 3)[3]  # drop "model.layers.{i}."
                if tail in suffix:
                    out[name] = suffix[tail]
                else:
                    ffn = (shape.moe_ffn_hidden_size if ".experts." in tail
                           else shape.shared_expert_ffn_hidden_size if "shared_expert." in tail
                           else shape.ffn_hidden_size)
                    out[name] = (h, ffn) if tail.endswith("down_proj.weight") else (ffn, h)
    return out


def megatron_shapes(shape: ModelShape) -> dict[str, tuple[int, ...]]:
    """Shape of every megatron-core (local name) tensor: fused rules add up their parts along dim 0."""
    hf = hf_shapes(shape)
    out = {}
    for r in rules_for(shape):
        parts = [hf[n] for n in r.hf]
        out[r.megatron] = (sum(p[0] for p in parts), *parts[0][1:])
    return out
