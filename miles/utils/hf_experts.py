"""MoE expert weights between transformers' in-memory layout and the checkpoint's names.

transformers 5 fuses the experts of Qwen2-/Qwen3-MoE when it loads them: each layer's
`mlp.experts.{e}.gate_proj.weight` / `up_proj.weight` ([I, H] each) become one parameter
`mlp.experts.gate_up_proj` [E, 2I, H] (per expert, gate rows then up rows), and the
`mlp.experts.{e}.down_proj.weight` ([H, I]) become `mlp.experts.down_proj` [E, H, I]; saving
reverses it. SGLang (and every HF checkpoint) knows the checkpoint names only, and logs a name it
does not know instead of failing, so a trainer that sent the in-memory names would leave the
engine's experts untrained without an error.

- `checkpoint_tensors(named, model_type)`: (name, tensor) in checkpoint naming, the fused experts
  split per expert (each a copy: a view would carry the whole fused storage through a transport);
  every other tensor passes through. tests/backends/test_moe_weight_names.py checks the result equals
  `save_pretrained`'s safetensors bit for bit.
- `fused_slice(params, name)`: for an engine holding the fused layout (the built-in engine), the
  view of its fused parameter that checkpoint tensor `name` fills, or None.

Pure torch indexing; no transformers import.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

FUSED_MODEL_TYPES = frozenset({"qwen2_moe", "qwen3_moe"})
"""Model types whose experts transformers 5 fuses as gate_up_proj/down_proj (checkpoint: gate/up/down_proj)."""

_FUSED = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<kind>gate_up_proj|down_proj)$")
_CHECKPOINT = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")


def checkpoint_tensors(named: Iterable[tuple[str, "torch.Tensor"]], model_type: str | None) -> Iterator[tuple[str, "torch.Tensor"]]:
    """`named` with fused expert tensors of a `FUSED_MODEL_TYPES` model split into checkpoint names."""
    fused = model_type in FUSED_MODEL_TYPES
    for name, tensor in named:
        m = _FUSED.match(name) if fused else None
        if m is None or tensor.dim() != 3:
            yield name, tensor
            continue
        prefix = m["prefix"]
        if m["kind"] == "gate_up_proj":
            half = tensor.shape[1] // 2
            for e in range(tensor.shape[0]):
                yield f"{prefix}.{e}.gate_proj.weight", tensor[e, :half].clone()
                yield f"{prefix}.{e}.up_proj.weight", tensor[e, half:].clone()
        else:
            for e in range(tensor.shape[0]):
                yield f"{prefix}.{e}.down_proj.weight", tensor[e].clone()


def fused_slice(params: Mapping[str, "torch.Tensor"], name: str) -> "torch.Tensor | None":
    """The view of a fused expert parameter in `params` that checkpoint tensor `name` is, or None when
    `name` is not an expert tensor of a fused parameter there."""
    m = _CHECKPOINT.match(name)
    if m is None:
        return None
    e, proj = int(m["e"]), m["proj"]
    if proj == "down_proj":
        fused = params.get(f"{m['prefix']}.down_proj")
        return fused[e] if fused is not None and fused.dim() == 3 and e < fused.shape[0] else None
    fused = params.get(f"{m['prefix']}.gate_up_proj")
    if fused is None or fused.dim() != 3 or e >= fused.shape[0]:
        return None
    half = fused.shape[1] // 2
    return fused[e, :half] if proj == "gate_proj" else fused[e, half:]
