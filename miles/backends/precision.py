"""Mixed precision shared by the trainers: the dtype the rollout engines hold their weights in (what
weights are cast to before they travel) and the autocast context of a `--bf16` forward.

- `engine_dtype(cfg)`: the built-in engine's `--rollout-dtype`; for SGLang, `--sglang-dtype`, and for
  its default "auto" SGLang's own rule (a bf16 checkpoint stays bf16, fp32 and fp16 checkpoints run
  in fp16), read from the checkpoint's config.json. Casting on the trainer side halves the bytes of a
  bf16 engine's update and makes `--check-weight-update-equal` compare like with like.
- `compute_context(device, bf16=...)`: `torch.autocast(bfloat16)` on that device type when `bf16`,
  otherwise a no-op context (the fp32 path runs exactly as without it).

Use: `with compute_context("cpu", bf16=True): logits = net(...)`;
`tensor.to(engine_dtype(cfg))`.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import torch

_SGLANG_AUTO = {"bfloat16": torch.bfloat16, "float32": torch.float16, "float16": torch.float16}


def engine_dtype(cfg) -> torch.dtype:
    """The dtype of the engines' weights for this run (see the module docstring)."""
    if cfg.rollout.rollout_backend != "sglang":
        return getattr(torch, cfg.rollout.rollout_dtype)
    name = cfg.sglang.sglang_dtype
    if name != "auto":
        return {"half": torch.float16, "float": torch.float32}.get(name) or getattr(torch, name)
    try:
        hf = json.loads((Path(cfg.rollout.hf_checkpoint) / "config.json").read_text())
    except (OSError, TypeError, ValueError):
        return torch.bfloat16  # no readable config: the dtype real checkpoints ship in
    return _SGLANG_AUTO.get(str(hf.get("dtype") or hf.get("torch_dtype") or "bfloat16"), torch.bfloat16)


def compute_context(device: str, *, bf16: bool) -> contextlib.AbstractContextManager:
    """bf16 autocast on `device`'s type when `bf16`, else a context that does nothing."""
    if not bf16:
        return contextlib.nullcontext()
    return torch.autocast(device_type=torch.device(device).type, dtype=torch.bfloat16)
