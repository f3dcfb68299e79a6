"""`miles convert --lora-export merged|adapter`: a LoRA run's checkpoint as a Hugging Face model or a PEFT adapter.

A LoRA checkpoint of the torch trainer (`<save>/iter_<id>/`: the adapter's tensors in a
torch.distributed.checkpoint plus PEFT's `adapter_config.json`, miles/backends/torch/checkpoint.py)
holds no base weights; the base is `--hf-checkpoint` (default: the directory the checkpoint's
adapter_config.json names, the run's own --hf-checkpoint).

- `merged`: base + scale·B·A in the base's Hugging Face names and files (config, tokenizer), a plain
  `AutoModelForCausalLM.from_pretrained` directory (miles.ckpt.hf_export, atomic);
- `adapter`: PEFT's own format (`adapter_config.json` + `adapter_model.safetensors`), loadable with
  `PeftModel.from_pretrained(base, DIR)` or as `--lora-adapter-path` of another run; written under a
  temporary name and renamed when complete.

Use: `export_lora(ConvertOptions(lora_export="merged", load="runs/x/checkpoints", save="out"))`.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from miles.config.convert import ConvertOptions
from miles.errors import UserError

ADAPTER_CONFIG = "adapter_config.json"


def lora_checkpoint_dir(load: str) -> Path:
    """The iteration directory of a LoRA checkpoint: the tracker's latest under a --save directory, or the
    iteration directory itself."""
    from miles.ckpt.trainer_checkpoint import find_latest_checkpoint

    path = Path(load)
    found = find_latest_checkpoint(path) if not (path / ADAPTER_CONFIG).is_file() else None
    ckpt = found[1] if found is not None else path
    if not (ckpt / ADAPTER_CONFIG).is_file() or not (ckpt / ".metadata").is_file():
        raise UserError(
            f"--load {load} is not a LoRA checkpoint of the torch trainer (no {ADAPTER_CONFIG} and .metadata in {ckpt}); pass "
            "the --save directory of a run with --lora-rank, or one of its iter_* directories.",
            option="--load",
        )
    return ckpt


def export_lora(opts: ConvertOptions) -> Path:
    """Write `opts.save` as `opts.lora_export` says (see the module docstring); returns its path."""
    from miles.backends.torch.lora import load_lora_model, merged_named_weights

    ckpt = lora_checkpoint_dir(opts.load)
    out = Path(opts.save).absolute()
    marker = "config.json" if opts.lora_export == "merged" else ADAPTER_CONFIG
    if out.exists() and not opts.force:
        raise UserError(f"--save {out} exists; pass --force to replace it or choose another directory.", option="--save")
    base = opts.hf_checkpoint or json.loads((ckpt / ADAPTER_CONFIG).read_text()).get("base_model_name_or_path")
    peft_model = load_lora_model(ckpt, base)
    if opts.lora_export == "merged":
        from miles.ckpt.hf_export import export_hf

        weights = {name: t.clone() for name, t in merged_named_weights(peft_model.base_model.model)}
        export_hf(weights, base, out, max_shard_bytes=opts.chunk_size)
    else:
        _save_adapter(peft_model, base, out)
    print(f"wrote {out} ({opts.lora_export}; {marker}) from {ckpt}")
    return out


def _save_adapter(peft_model, base: str, out: Path) -> None:
    from miles.ckpt.durable import publish_dir

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f"{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    peft_model.save_pretrained(str(tmp), safe_serialization=True)
    config_path = tmp / ADAPTER_CONFIG
    config = json.loads(config_path.read_text())
    config["base_model_name_or_path"] = str(base)
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True))
    publish_dir(tmp, out)
