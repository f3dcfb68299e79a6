"""`miles eval`: score a model on the eval datasets with the eval sampling settings.

The model is a Hugging Face directory, or a miles checkpoint directory (`--save` of a run, holding
`latest_checkpointed_iteration.txt`) whose trainer weights are loaded into the engine on top of
`--hf-checkpoint`'s architecture (a LoRA checkpoint's adapter is merged onto `--hf-checkpoint`, its
base). It starts no trainer, only the engine --rollout-backend names (the built-in engine in this
process, or engine servers behind the router), prints the `eval/<dataset>/...` metrics as a table and writes them to
`<run dir>/eval/<label>.json` (written to a temporary name, then renamed).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from rich.console import Console
from rich.table import Table

from miles.errors import UserError

console = Console()


def _checkpoint_weights(path: Path, base: str | None):
    from miles.ckpt.trainer_checkpoint import find_latest_checkpoint

    found = find_latest_checkpoint(path, flag="--checkpoint")  # reads only: the run may be live
    if found is None:
        raise UserError(f"--checkpoint {path} holds no complete checkpoint (no latest_checkpointed_iteration.txt).", option="--checkpoint")
    rollout_id, ckpt_dir, _ = found
    if not (ckpt_dir / ".metadata").is_file():
        raise UserError(
            f"--checkpoint {path}: {ckpt_dir.name} is not a torch-backend checkpoint (no .metadata); convert it to a "
            "Hugging Face directory with `miles convert` and pass that directory.",
            option="--checkpoint",
        )
    from miles.backends.torch.lora import is_lora_checkpoint

    if is_lora_checkpoint(ckpt_dir):  # the adapter alone: merged onto its base (--hf-checkpoint)
        from miles.backends.torch.lora import merged_weights_of_checkpoint

        return rollout_id, merged_weights_of_checkpoint(ckpt_dir, base)
    from miles.backends.torch.checkpoint import read_model_weights

    return rollout_id, read_model_weights(str(ckpt_dir))


def run_eval(cfg, *, checkpoint: str | None, run_dir: str) -> dict[str, float]:
    from miles.ray.rollout_manager import RolloutManager

    label = "hf_checkpoint"
    weights = None
    if checkpoint:
        path = Path(checkpoint)
        if (path / "config.json").is_file():
            cfg.rollout.hf_checkpoint = str(path)
            label = path.name
        elif (path / "latest_checkpointed_iteration.txt").is_file():
            rollout_id, weights = _checkpoint_weights(path, cfg.rollout.hf_checkpoint)
            label = f"rollout_{rollout_id}"
        else:
            raise UserError(
                f"--checkpoint {path} is neither a Hugging Face model directory (config.json) nor a miles checkpoint "
                "directory (latest_checkpointed_iteration.txt).",
                option="--checkpoint",
            )
    manager = RolloutManager(cfg, train_data=False, threads=os.cpu_count() or 1)
    if weights is not None:
        manager.update_weights([list(weights.items())], version=0)
    with console.status("evaluating"):
        metrics = manager.eval(0)
    table = Table(title=f"miles eval — {label}")
    table.add_column("Metric", style="cyan")
    table.add_column("Value", justify="right")
    for key in sorted(metrics):
        table.add_row(key, f"{metrics[key]:.4f}")
    console.print(table)
    out = Path(run_dir) / "eval" / f"{label}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(metrics, indent=2, sort_keys=True))
    os.replace(tmp, out)
    console.print(f"Wrote {out}")
    return metrics
