"""LoRA options (`cfg.lora`): train low-rank adapters on a frozen base instead of every weight.

Upstream miles' names and defaults (`--lora-rank 0` = off, `--lora-alpha 16`, `--lora-dropout 0.0`,
`--target-modules`, `--exclude-modules`, `--lora-adapter-path`, `--lora-sync-from-tensor`). What a
LoRA run is in miles (miles/backends/torch/lora.py): PEFT adapters on the torch trainer's model;
only adapter parameters reach the optimizer; the reference log-probs of a KL term are the base's
(adapters disabled, no second model); engines get merged weights (base + adapter) in Hugging Face
names through the usual weight buckets; checkpoints hold the adapter and its optimizer state.

`target_module_names(cfg, hf_config)` expands `all-linear` the way upstream does. `check(cfg)` rejects
combinations that cannot run, one sentence each. Nothing here imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from miles.config.fields import option
from miles.errors import UserError

ALL_LINEAR = "all-linear"
ALL_LINEAR_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""What `--target-modules all-linear` means (upstream's expansion): every linear layer of attention and MLP,
never the embeddings or the LM head."""
MLA_KV_MODULES = ("kv_a_proj_with_mqa", "kv_b_proj")
MLA_Q_MODULES = ("q_a_proj", "q_b_proj")


@dataclass
class LoraConfig:
    lora_rank: int = option(0, help="LoRA rank: train rank-r adapters on a frozen base model instead of all weights; 0 = off (full fine-tuning).")
    lora_alpha: int = option(16, help="LoRA alpha: the adapter's update is scaled by alpha / rank.")
    lora_dropout: float = option(0.0, help="Dropout on the adapters' input during training (the base path has none).")
    target_modules: list[str] | None = option(
        None,
        help="Modules that get adapters, needed with --lora-rank > 0: all-linear (q/k/v/o and gate/up/down projections, plus the "
        "MLA projections a model has; never embeddings or the LM head) or module names (several values or a comma list).",
    )
    exclude_modules: list[str] | None = option(
        None, help="Module names removed from --target-modules after its expansion (several values or a comma list)."
    )
    lora_adapter_path: str | None = option(
        None,
        help="Start from this adapter (a PEFT directory: adapter_config.json + adapter weights) instead of a fresh one; its "
        "rank, alpha and target modules are used, and it alone turns LoRA on.",
    )
    lora_sync_from_tensor: bool = option(
        False,
        help="Send engines only the adapter (unmerged) instead of merged weights.",
        unsupported="sending only the adapter needs an engine that serves LoRA adapters (SGLang's /load_lora_adapter "
        "endpoints), which miles does not drive yet; without the flag engines get the merged weights",
    )

    @property
    def enabled(self) -> bool:
        """LoRA is on with a rank, or with an adapter to start from (upstream's rule)."""
        return self.lora_rank > 0 or self.lora_adapter_path is not None


def split_names(values: list[str] | None) -> list[str]:
    """`["q_proj,v_proj", "o_proj"]` -> `["q_proj", "v_proj", "o_proj"]` (both spellings are accepted)."""
    return [n.strip() for v in values or () for n in v.split(",") if n.strip()]


def target_module_names(lora: LoraConfig, hf_config: Any = None) -> list[str]:
    """The module names that get adapters: `all-linear` expanded (plus the MLA projections when the model
    has them, read from its HF config), then `--exclude-modules` removed."""
    out: list[str] = []
    for name in split_names(lora.target_modules):
        if name == ALL_LINEAR:
            out.extend(ALL_LINEAR_MODULES)
            if getattr(hf_config, "kv_lora_rank", None):
                out.extend(MLA_KV_MODULES)
            if getattr(hf_config, "q_lora_rank", None):
                out.extend(MLA_Q_MODULES)
        else:
            out.append(name)
    excluded = set(split_names(lora.exclude_modules))
    return [n for n in dict.fromkeys(out) if n not in excluded]


def check(cfg: Any) -> None:
    """Reject LoRA settings that cannot run (called by `miles.config.resolve`)."""
    lo = cfg.lora
    if lo.lora_rank < 0:
        raise UserError("--lora-rank must be >= 0 (0 = off).", option="--lora-rank")
    if not lo.enabled:
        for flag, value, default in (
            ("--lora-alpha", lo.lora_alpha, 16),
            ("--lora-dropout", lo.lora_dropout, 0.0),
            ("--target-modules", lo.target_modules, None),
            ("--exclude-modules", lo.exclude_modules, None),
        ):
            if value != default:
                raise UserError(f"{flag} applies only to LoRA runs; add --lora-rank N (e.g. 8) or drop {flag}.", option=flag)
        return
    if lo.lora_alpha <= 0:
        raise UserError("--lora-alpha must be positive (the update is scaled by alpha / rank).", option="--lora-alpha")
    if not 0 <= lo.lora_dropout < 1:
        raise UserError("--lora-dropout must be in [0, 1).", option="--lora-dropout")
    if lo.lora_adapter_path is None:
        if not split_names(lo.target_modules):
            raise UserError("--lora-rank needs --target-modules: give all-linear or module names (e.g. q_proj,v_proj).", option="--target-modules")
        if not target_module_names(lo):
            raise UserError("--exclude-modules removes every module of --target-modules; keep at least one.", option="--exclude-modules")
    backend = cfg.train.train_backend
    if backend == "megatron":
        raise UserError(
            "--lora-rank with --train-backend megatron cannot run: megatron-core 0.16.1 has no LoRA (that lives in Megatron-Bridge, "
            "which miles does not use); use --train-backend torch.",
            option="--lora-rank",
        )
    if backend == "fsdp":
        raise UserError(
            "--lora-rank with --train-backend fsdp is not supported yet (the adapters are small, so every worker can hold them); "
            "use --train-backend torch.",
            option="--lora-rank",
        )
    ref, base = cfg.ckpt.ref_load, cfg.rollout.hf_checkpoint
    if ref is not None and base is not None and ref != base:
        raise UserError(
            "--ref-load cannot differ from --hf-checkpoint in a LoRA run: the reference is the base model with its adapters "
            "disabled; drop --ref-load.",
            option="--ref-load",
        )
