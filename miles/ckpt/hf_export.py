"""Export trained weights as a Hugging Face model directory (`--save-hf`), written atomically.

`export_hf(model_or_state, config_src_dir, out_dir)` writes into `<out_dir>.tmp-<pid>` and renames it
to `out_dir` when complete, so a reader never sees half a model. What a killed export left next to
its output (`*.tmp-<pid>`, `*.old-<pid>` of a process that no longer runs) is removed by the next
export into the same parent directory:

- the weights as safetensors: one `model.safetensors`, or shards of at most `max_shard_bytes` plus
  `model.safetensors.index.json`; a tensor sharing storage with an earlier one (a tied `lm_head`)
  is written once, as Hugging Face does;
- every other file of `config_src_dir` (config.json, generation_config.json, tokenizer files, chat
  template), copied unchanged; its weight files are not copied.

The weights are taken in Hugging Face naming: a `PreTrainedModel`'s `state_dict()`, or an iterable of
(name, tensor) such as `TorchBackend.named_weights_for_sync()`. Not a converter: a megatron
checkpoint goes through `miles convert` first.

Use: `export_hf(trainer.model, hf_dir, "runs/x/hf_step_10")`, then
`AutoModelForCausalLM.from_pretrained("runs/x/hf_step_10")`.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from pathlib import Path
from typing import Iterable, Mapping

import torch

from miles.ckpt.durable import publish_dir

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack")
WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
DEFAULT_MAX_SHARD_BYTES = 5 * 1024**3
_LEFTOVER_RE = re.compile(r"^.+\.(?:tmp|old)-(\d+)$")

logger = logging.getLogger(__name__)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's live process
    return True


def _remove_leftovers(parent: Path) -> None:
    """Remove the temp/old directories of exports whose process died (a live writer's are kept)."""
    for entry in parent.iterdir():
        m = _LEFTOVER_RE.match(entry.name)
        if m and entry.is_dir() and int(m.group(1)) != os.getpid() and not _pid_alive(int(m.group(1))):
            logger.warning("removing %s, left by an interrupted Hugging Face export", entry)
            shutil.rmtree(entry, ignore_errors=True)


def _named_tensors(model_or_state) -> Iterable[tuple[str, torch.Tensor]]:
    if isinstance(model_or_state, torch.nn.Module):
        return model_or_state.state_dict().items()
    if isinstance(model_or_state, Mapping):
        return model_or_state.items()
    return model_or_state


def _shards(
    tensors: Iterable[tuple[str, torch.Tensor]], max_shard_bytes: int, dtype: torch.dtype | None
) -> list[dict[str, torch.Tensor]]:
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    seen: set[tuple[int, int]] = set()
    for name, t in tensors:
        key = (t.untyped_storage().data_ptr(), t.storage_offset())
        if key in seen:  # tied weight: HF re-ties it from the config on load
            continue
        seen.add(key)
        t = t.detach().to("cpu", dtype=dtype or t.dtype).contiguous()
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        # safetensors refuses tensors that share memory; a clone makes each one its own.
        shards[-1][name] = t.clone() if t.untyped_storage().nbytes() != nbytes else t
        size += nbytes
    return shards


def export_hf(
    model_or_state: torch.nn.Module | Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
    config_src_dir: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    dtype: torch.dtype | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> Path:
    """Write an HF model directory at `out_dir` (replacing an existing one) and return its path.

    `dtype` converts the weights (e.g. torch.bfloat16 for a smaller export); None keeps theirs.
    """
    from safetensors.torch import save_file

    src = Path(config_src_dir)
    if not (src / "config.json").is_file():
        raise FileNotFoundError(f"{src} has no config.json; export_hf copies the model config from there")
    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    _remove_leftovers(out.parent)
    tmp = out.parent / f"{out.name}.tmp-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()

    for entry in sorted(src.iterdir()):
        if entry.is_file() and not entry.name.endswith(WEIGHT_SUFFIXES) and entry.name not in WEIGHT_INDEXES:
            shutil.copy2(entry, tmp / entry.name)

    shards = _shards(_named_tensors(model_or_state), max_shard_bytes, dtype)
    if len(shards) == 1:
        save_file(shards[0], str(tmp / "model.safetensors"), metadata={"format": "pt"})
    else:
        weight_map, total = {}, 0
        for k, shard in enumerate(shards, start=1):
            fname = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(tmp / fname), metadata={"format": "pt"})
            for name, t in shard.items():
                weight_map[name] = fname
                total += t.numel() * t.element_size()
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True))
    if dtype is not None:
        # Keep config.json's declared dtype in step with the weights written.
        cfg_path = tmp / "config.json"
        cfg = json.loads(cfg_path.read_text())
        cfg["dtype"] = str(dtype).removeprefix("torch.")
        cfg.pop("torch_dtype", None)
        cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True))

    publish_dir(tmp, out)
    return out
