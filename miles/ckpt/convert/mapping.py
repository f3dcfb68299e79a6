"""The HF <-> megatron-core tensor mapping: a table of rules per family, and pure functions.

Each `Rule` ties one megatron-core GPTModel (local layer spec) parameter to the HF tensors it is made of:

- `copy`:    one HF tensor, renamed (norms, o_proj -> linear_proj, embeddings, router, ...);
- `qkv`:     q_proj, k_proj, v_proj fused *per query group*: megatron's `linear_qkv` stores, for each of
             the `num_query_groups` groups, that group's query heads, then its key head, then its value
             head ([q_g0.., k_g0, v_g0, q_g1.., k_g1, v_g1, ...]); biases follow the same layout;
- `gate_up`: gate_proj and up_proj stacked as megatron's SwiGLU `linear_fc1` = gate ‖ up (dim 0).

`rules_for(shape)` lists the rules in file order (embeddings, then layer by layer, then final norm and
output layer), so a streaming converter can read/write one rule at a time. `hf_to_megatron` and
`megatron_to_hf` apply one rule; `*_state_dict` apply all of them to in-memory dicts (tests, weight sync).

Every rule is a row-block permutation along dim 0 of row-major tensors (no arithmetic), so
`row_blocks(rule, shape, rows)` states it as data: the fused tensor's rows, in order, as blocks of the
HF parts' rows. `miles convert` moves exactly those byte ranges (bytecopy.py) and never needs torch;
`split_blocks` is its inverse, derived from it, and tests check both against `fuse_qkv`/`torch.cat`.

What it is not: a layer-spec-agnostic mapper. Names are those of megatron-core 0.16.1's local spec
(`get_gpt_layer_local_spec`, SequentialMLP experts); TransformerEngine specs fuse norms into linears.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator, Literal

from miles.ckpt.convert.families import ModelShape

if TYPE_CHECKING:
    import torch

Kind = Literal["copy", "qkv", "gate_up"]


@dataclass(frozen=True)
class Rule:
    kind: Kind
    hf: tuple[str, ...]
    megatron: str


_ATTN = "model.layers.{i}.self_attn."
_MG = "decoder.layers.{i}."


def _gated_mlp(hf_prefix: str, mg_prefix: str) -> list[Rule]:
    return [
        Rule("gate_up", (hf_prefix + "gate_proj.weight", hf_prefix + "up_proj.weight"), mg_prefix + "linear_fc1.weight"),
        Rule("copy", (hf_prefix + "down_proj.weight",), mg_prefix + "linear_fc2.weight"),
    ]


def _layer_rules(shape: ModelShape) -> list[Rule]:
    rules = [
        Rule("copy", ("model.layers.{i}.input_layernorm.weight",), _MG + "input_layernorm.weight"),
        Rule("qkv", tuple(_ATTN + f"{p}_proj.weight" for p in "qkv"), _MG + "self_attention.linear_qkv.weight"),
    ]
    if shape.qkv_bias:
        rules.append(Rule("qkv", tuple(_ATTN + f"{p}_proj.bias" for p in "qkv"), _MG + "self_attention.linear_qkv.bias"))
    if shape.qk_layernorm:
        rules += [
            Rule("copy", (_ATTN + "q_norm.weight",), _MG + "self_attention.q_layernorm.weight"),
            Rule("copy", (_ATTN + "k_norm.weight",), _MG + "self_attention.k_layernorm.weight"),
        ]
    rules += [
        Rule("copy", (_ATTN + "o_proj.weight",), _MG + "self_attention.linear_proj.weight"),
        Rule("copy", ("model.layers.{i}.post_attention_layernorm.weight",), _MG + "pre_mlp_layernorm.weight"),
    ]
    if not shape.is_moe:
        return rules + _gated_mlp("model.layers.{i}.mlp.", _MG + "mlp.")
    rules.append(Rule("copy", ("model.layers.{i}.mlp.gate.weight",), _MG + "mlp.router.weight"))
    for e in range(shape.num_experts):
        rules += _gated_mlp(f"model.layers.{{i}}.mlp.experts.{e}.", _MG + f"mlp.experts.local_experts.{e}.")
    if shape.shared_expert_ffn_hidden_size:
        rules += _gated_mlp("model.layers.{i}.mlp.shared_expert.", _MG + "mlp.shared_experts.")
    if shape.shared_expert_gate:
        rules.append(Rule("copy", ("model.layers.{i}.mlp.shared_expert_gate.weight",), _MG + "mlp.shared_experts.gate_weight"))
    return rules


def rules_for(shape: ModelShape) -> list[Rule]:
    """All rules of a model, concrete (layer index filled in), in checkpoint order."""
    rules = [Rule("copy", ("model.embed_tokens.weight",), "embedding.word_embeddings.weight")]
    layer = _layer_rules(shape)
    for i in range(shape.num_layers):
        rules += [Rule(r.kind, tuple(h.format(i=i) for h in r.hf), r.megatron.format(i=i)) for r in layer]
    rules.append(Rule("copy", ("model.norm.weight",), "decoder.final_layernorm.weight"))
    if not shape.tie_word_embeddings:
        # Tied models have no output_layer.weight: megatron-core reuses the embedding, as HF does.
        rules.append(Rule("copy", ("lm_head.weight",), "output_layer.weight"))
    return rules


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, shape: ModelShape) -> torch.Tensor:
    """[q; k; v] in HF layout -> megatron's per-group interleaved linear_qkv (weight or bias)."""
    import torch

    g, rest = shape.num_query_groups, q.shape[1:]
    parts = [t.reshape(g, -1, *rest) for t in (q, k, v)]
    return torch.cat(parts, dim=1).reshape(-1, *rest)


def split_qkv(qkv: torch.Tensor, shape: ModelShape) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of `fuse_qkv`."""
    g, d, rest = shape.num_query_groups, shape.head_dim, qkv.shape[1:]
    grouped = qkv.reshape(g, (shape.heads_per_group + 2) * d, *rest)
    q, k, v = grouped.split([shape.heads_per_group * d, d, d], dim=1)
    return tuple(t.reshape(-1, *rest).contiguous() for t in (q, k, v))  # type: ignore[return-value]


def row_blocks(rule: Rule, shape: ModelShape, part_rows: list[int]) -> list[tuple[int, int, int]]:
    """The megatron tensor's rows in order, as (HF part index, first row, row count) blocks.

    `part_rows` is dim 0 of each HF part. QKV: per query group, that group's query heads, its key
    head, its value head; gate_up: gate then up; copy: the one part.
    """
    if rule.kind == "qkv":
        d, hpg = shape.head_dim, shape.heads_per_group
        blocks = []
        for g in range(shape.num_query_groups):
            blocks += [(0, g * hpg * d, hpg * d), (1, g * d, d), (2, g * d, d)]
        return blocks
    return [(i, 0, n) for i, n in enumerate(part_rows)]


def split_blocks(rule: Rule, shape: ModelShape, part_rows: list[int]) -> list[list[tuple[int, int]]]:
    """Inverse of `row_blocks`: for each HF part, its rows in order as (first row, count) of the megatron tensor."""
    placed: list[list[tuple[int, int, int]]] = [[] for _ in part_rows]
    at = 0
    for part, first, n in row_blocks(rule, shape, part_rows):
        placed[part].append((first, at, n))
        at += n
    out = []
    for rows, blocks in zip(part_rows, placed):
        blocks.sort()
        if [b[0] for b in blocks] != [sum(b[2] for b in blocks[:i]) for i in range(len(blocks))] or sum(b[2] for b in blocks) != rows:
            raise ValueError(f"{rule.megatron}: row blocks do not cover each part exactly once")
        out.append([(a, n) for _, a, n in blocks])
    return out


def hf_to_megatron(rule: Rule, tensors: list[torch.Tensor], shape: ModelShape) -> torch.Tensor:
    import torch

    if rule.kind == "copy":
        return tensors[0]
    if rule.kind == "qkv":
        return fuse_qkv(*tensors, shape)
    return torch.cat(tensors, dim=0)


def megatron_to_hf(rule: Rule, tensor: torch.Tensor, shape: ModelShape) -> list[torch.Tensor]:
    if rule.kind == "copy":
        return [tensor]
    if rule.kind == "qkv":
        return list(split_qkv(tensor, shape))
    gate, up = tensor.chunk(2, dim=0)
    return [gate.contiguous(), up.contiguous()]


def hf_to_megatron_state_dict(hf: dict[str, torch.Tensor], shape: ModelShape) -> dict[str, torch.Tensor]:
    """Whole-dict version of the mapping (HF names -> megatron-core local-spec names)."""
    return {r.megatron: hf_to_megatron(r, [hf[n] for n in r.hf], shape) for r in rules_for(shape)}


def megatron_to_hf_state_dict(mg: dict[str, torch.Tensor], shape: ModelShape) -> dict[str, torch.Tensor]:
    """Whole-dict inverse of `hf_to_megatron_state_dict`."""
    out: dict[str, torch.Tensor] = {}
    for r in rules_for(shape):
        out.update(zip(r.hf, megatron_to_hf(r, mg[r.megatron], shape)))
    return out


def iter_hf_names(shape: ModelShape) -> Iterator[str]:
    for r in rules_for(shape):
        yield from r.hf
