"""LoRA on the torch trainer through PEFT: adapters on a frozen base, merged weights for the engines.

`attach_lora(model, cfg)` wraps a Hugging Face causal LM with PEFT's LoRA (`get_peft_model`, or
`PeftModel.from_pretrained` with `--lora-adapter-path`) and returns the `PeftModel`. PEFT injects the
adapters into the HF model in place, so the trainer keeps running the same HF module (its forward,
DDP, the optimizer); what changes:

- every base parameter is frozen (`requires_grad=False`), so `build_optimizer`, which takes the
  trainable parameters, gets the adapters alone, and AdamW keeps moments for them only;
- the reference model of a KL term is this model with its adapters disabled (`reference_forward`):
  the frozen base, with no second copy in memory;
- `merged_named_weights(model)` gives the engines base + scale·B·A under the base's Hugging Face names
  (`...q_proj.weight`, never PEFT's `base_layer`/`lora_A` names), through the usual weight buckets;
- checkpoints hold the adapter and its optimizer state (miles/backends/torch/checkpoint.py), plus
  `adapter_config.json` (PEFT's own), which marks a LoRA checkpoint and names its base;
- `parameter_summary(model, optimizer)`: the trainable count and share, and the optimizer's memory,
  for the start-up line and the metrics.

Adapter initialisation draws from torch's global RNG, which the trainer seeded just before, so two runs
with the same `--seed` start from the same adapter.

Use (inside `TorchBackend`): `peft_model = attach_lora(hf_model, cfg)`; keep training `hf_model`.
"""

from __future__ import annotations

import contextlib
import json
import os
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

import torch

from miles.config.lora import ALL_LINEAR, split_names, target_module_names
from miles.errors import UserError

if TYPE_CHECKING:
    from miles.config.engine import EngineConfig

ADAPTER_CONFIG = "adapter_config.json"
"""PEFT's adapter config file; in a miles checkpoint directory it marks a LoRA checkpoint."""
ADAPTER_NAME = "default"


def _linear_names(model: torch.nn.Module) -> set[str]:
    return {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}


def peft_config(cfg: "EngineConfig", model: torch.nn.Module):
    """PEFT's `LoraConfig` for this run's options and model (all-linear keeps the projections the model has)."""
    from peft import LoraConfig as PeftLoraConfig

    lo = cfg.lora
    targets = target_module_names(lo, model.config)
    present = _linear_names(model)
    if ALL_LINEAR in split_names(lo.target_modules):
        explicit = [n for n in split_names(lo.target_modules) if n != ALL_LINEAR]
        targets = [t for t in targets if t in present or t in explicit]
    missing = [t for t in targets if t not in present]
    if missing or not targets:
        raise UserError(
            f"--target-modules: {', '.join(missing) or 'nothing'} is not a linear layer of this model; its linear layers are "
            f"{', '.join(sorted(present - {'lm_head'}))}.",
            option="--target-modules",
        )
    return PeftLoraConfig(
        r=lo.lora_rank,
        lora_alpha=lo.lora_alpha,
        lora_dropout=lo.lora_dropout,
        target_modules=targets,
        bias="none",
        task_type="CAUSAL_LM",
    )


def attach_lora(model: torch.nn.Module, cfg: "EngineConfig"):
    """The `PeftModel` around `model` (adapters injected into `model` in place), base parameters frozen."""

    lo = cfg.lora
    path = lo.lora_adapter_path
    with warnings.catch_warnings():
        # PEFT asks transformers 5 a deprecated question (is_gradient_checkpointing); not the user's business.
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        return _attach(model, cfg, path)


def _attach(model: torch.nn.Module, cfg: "EngineConfig", path: str | None):
    from peft import PeftConfig, PeftModel, get_peft_model

    lo = cfg.lora
    if path is None:
        return get_peft_model(model, peft_config(cfg, model))
    if not (Path(path) / ADAPTER_CONFIG).is_file():
        raise UserError(f"--lora-adapter-path {path} has no {ADAPTER_CONFIG}; pass a PEFT adapter directory.", option="--lora-adapter-path")
    saved = PeftConfig.from_pretrained(path)
    if lo.lora_rank > 0 and lo.lora_rank != saved.r:
        raise UserError(
            f"--lora-rank {lo.lora_rank} differs from the adapter's rank {saved.r} in --lora-adapter-path {path}; drop --lora-rank "
            "(the adapter's own is used).",
            option="--lora-rank",
        )
    return PeftModel.from_pretrained(model, path, is_trainable=True)


def lora_layers(model: torch.nn.Module) -> dict[str, Any]:
    """{module path: PEFT LoRA layer} of a model with injected adapters."""
    from peft.tuners.lora import LoraLayer

    return {name: m for name, m in model.named_modules() if isinstance(m, LoraLayer)}


def merged_named_weights(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) of the merged model (base + adapter), each parameter once (a tied head skipped):
    exactly the names and tensors of the base model after `merge_and_unload()`, without changing the model."""
    layers = lora_layers(model)
    seen: set[int] = set()
    for key, tensor in model.state_dict(keep_vars=True).items():
        parts = key.split(".")
        if any(p.startswith("lora_") for p in parts) or id(tensor) in seen:
            continue
        seen.add(id(tensor))
        if "base_layer" not in parts:
            yield key, tensor.detach()
            continue
        at = parts.index("base_layer")
        prefix, name = ".".join(parts[:at]), ".".join(parts[:at] + parts[at + 1 :])
        layer = layers[prefix]
        if parts[-1] == "weight" and ADAPTER_NAME in layer.lora_A and not layer.disable_adapters:
            with torch.no_grad():
                yield name, tensor.detach() + layer.get_delta_weight(ADAPTER_NAME).to(tensor.dtype)
        else:
            yield name, tensor.detach()


@contextlib.contextmanager
def adapters_disabled(peft_model) -> Iterator[None]:
    """The base model: every adapter off for the duration (the reference forward)."""
    with peft_model.disable_adapter():
        yield


def adapter_state(peft_model) -> dict[str, torch.Tensor]:
    """The adapter's tensors in PEFT's saved naming (`base_model.model....lora_A.weight`)."""
    from peft import get_peft_model_state_dict

    return get_peft_model_state_dict(peft_model)


def write_adapter_config(peft_model, directory: str | os.PathLike[str], base_model: str | None) -> None:
    """PEFT's adapter_config.json of this run, with the base it applies to."""
    config = peft_model.peft_config[ADAPTER_NAME].to_dict()
    config["base_model_name_or_path"] = base_model
    config = {k: (sorted(v) if isinstance(v, set) else v) for k, v in config.items()}
    Path(directory, ADAPTER_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True))


def is_lora_checkpoint(directory: str | os.PathLike[str]) -> bool:
    return (Path(directory) / ADAPTER_CONFIG).is_file()


def parameter_summary(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, float]:
    """Trainable and total parameter counts (each tensor once), the trainable share, and the optimizer
    state's bytes: measured when it exists, else AdamW's two fp32 moments per trainable parameter."""
    seen: set[int] = set()
    total = trainable = 0
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        total += p.numel()
        trainable += p.numel() if p.requires_grad else 0
    state_bytes = 0
    if optimizer is not None:
        for state in optimizer.state.values():
            state_bytes += sum(v.numel() * v.element_size() for v in state.values() if torch.is_tensor(v))
    if state_bytes == 0:  # before the first step AdamW has allocated nothing yet
        state_bytes = 2 * 4 * trainable
    return {
        "train/trainable_params": float(trainable),
        "train/total_params": float(total),
        "train/trainable_share": trainable / total if total else 0.0,
        "train/optimizer_state_bytes": float(state_bytes),
    }


def load_lora_model(checkpoint_dir: str | os.PathLike[str], base_dir: str | None = None):
    """A `PeftModel` (fp32, CPU) of a LoRA trainer checkpoint: the base from `base_dir` (default: the
    one its adapter_config.json names) with the checkpoint's adapter loaded."""
    from peft import LoraConfig as PeftLoraConfig, get_peft_model

    from miles.backends.torch.checkpoint import read_model_weights

    config = json.loads((Path(checkpoint_dir) / ADAPTER_CONFIG).read_text())
    base = base_dir or config.get("base_model_name_or_path")
    if not base or not (Path(base) / "config.json").is_file():
        raise UserError(
            f"the LoRA checkpoint {checkpoint_dir} needs its base model, and {base!r} is not a Hugging Face directory; pass "
            "--hf-checkpoint BASE_DIR.",
            option="--hf-checkpoint",
        )
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32, attn_implementation="eager")
    known = set(PeftLoraConfig.__dataclass_fields__)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        peft_model = get_peft_model(model, PeftLoraConfig(**{k: v for k, v in config.items() if k in known}))
    weights = read_model_weights(str(checkpoint_dir))
    missing, unexpected = _load_adapter_weights(model, weights)
    if missing or unexpected:
        raise ValueError(f"{checkpoint_dir}: adapter tensors do not match the model (missing {missing[:3]}, unexpected {unexpected[:3]})")
    return peft_model


def _load_adapter_weights(model: torch.nn.Module, weights: dict[str, torch.Tensor]) -> tuple[list[str], list[str]]:
    """Copy the checkpoint's trainable tensors (keyed as `model.state_dict()` keys them) into `model`."""
    params = {name: p for name, p in model.named_parameters() if p.requires_grad}
    missing = sorted(set(params) - set(weights))
    unexpected = sorted(set(weights) - set(params))
    with torch.no_grad():
        for name, p in params.items():
            if name in weights:
                p.copy_(weights[name])
    return missing, unexpected


def merged_weights_of_checkpoint(checkpoint_dir: str | os.PathLike[str], base_dir: str | None = None) -> dict[str, torch.Tensor]:
    """The merged (base + adapter) HF-named weights of a LoRA trainer checkpoint (for `miles eval`)."""
    peft_model = load_lora_model(checkpoint_dir, base_dir)
    return {name: t.clone() for name, t in merged_named_weights(peft_model.base_model.model)}
