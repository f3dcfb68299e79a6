"""What `miles convert --from torch_dist --load DIR` converts, and where its HF config comes from.

`--load` may be any checkpoint miles writes: a run's `checkpoints/` directory (the tracker names the
latest complete iteration; `--ckpt-step N` picks `iter_N`), one `iter_*` directory of it, or the
output of `miles convert --to torch_dist` (`release/`). Inside, the format is told apart by its files:
megatron-core's torch_dist has `metadata.json`, the torch backend's DCP (DDP or FSDP2) only `.metadata`.

The HF config and tokenizer (the "origin") come from, in order: `--origin-hf-dir`; the `hf_assets/`
copy a conversion from HF keeps; the run's record (`run.json` next to `checkpoints/`, which names the
run's `--hf-checkpoint`). Otherwise one sentence says to pass `--origin-hf-dir`. Reads files only.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from miles.ckpt.checkpoint_dir import ITER_RE, TRACKER, iter_dir_name, latest_checkpoint, list_checkpoints
from miles.ckpt.convert.trainer_dcp import DCP_METADATA, MEGATRON_MARKER
from miles.errors import UserError

ASSETS_DIR = "hf_assets"
RUN_RECORD = "run.json"  # miles.run_identity.RUN_RECORD (not imported: that module is a layer above)


@dataclass(frozen=True)
class Located:
    directory: Path  # holds the checkpoint files
    kind: str  # "megatron" (torch_dist) or "torch" (the torch backend's DCP)


def _kind(d: Path) -> str | None:
    if (d / MEGATRON_MARKER).is_file():
        return "megatron"
    if (d / DCP_METADATA).is_file():
        return "torch"
    return None


def _steps(load: Path) -> str:
    ids = list_checkpoints(load)
    return ", ".join(str(i) for i in ids) if ids else "none"


def locate_checkpoint(load: Path, ckpt_step: int | None = None) -> Located:
    """The checkpoint directory `--load` (and `--ckpt-step`) name; a `UserError` naming the fix otherwise."""
    if ckpt_step is not None:
        sub = load / iter_dir_name(ckpt_step)
        kind = _kind(sub)
        if kind is None:
            raise UserError(
                f"--ckpt-step {ckpt_step}: {load} has no complete {sub.name} (complete steps: {_steps(load)}); "
                "pick one of those, or pass --load the run's checkpoints/ directory.",
                option="--ckpt-step",
            )
        return Located(sub, kind)
    kind = _kind(load)
    if kind is not None:
        return Located(load, kind)
    if (load / TRACKER).is_file():
        text = (load / TRACKER).read_text().strip()
        if text == "release":
            sub = load / "release"
        else:
            found = latest_checkpoint(load, flag="--load")
            sub = found.path if found else load
        kind = _kind(sub)
        if kind is None:
            raise UserError(
                f"--load {load}: {TRACKER} names {sub.name}, which holds no checkpoint files (no {MEGATRON_MARKER} "
                f"or {DCP_METADATA}); pick a complete one with --ckpt-step (complete steps: {_steps(load)}).",
                option="--load",
            )
        return Located(sub, kind)
    if list_checkpoints(load):
        raise UserError(
            f"--load {load} has iter_* directories but no {TRACKER}; pick one with --ckpt-step "
            f"(complete steps: {_steps(load)}).",
            option="--ckpt-step",
        )
    raise UserError(
        f"--load {load} has no {TRACKER}, no {MEGATRON_MARKER} and no {DCP_METADATA}, so it holds no checkpoint; pass a "
        "run's checkpoints/ directory, one of its iter_* directories, or the output of `miles convert --to torch_dist`.",
        option="--load",
    )


def _run_record_origin(candidates: list[Path]) -> tuple[Path, Path] | None:
    """(run.json, the --hf-checkpoint it names) for the first run record found among `candidates`."""
    for d in candidates:
        record = d / RUN_RECORD
        if not record.is_file():
            continue
        try:
            hf = json.loads(record.read_text()).get("identity", {}).get("hf_checkpoint")
        except (OSError, ValueError):
            continue
        if hf:
            return record, Path(hf)
    return None


def find_origin(load: Path, located: Located, origin_hf_dir: str | None) -> Path:
    """The HF model directory whose config.json (and tokenizer) the converted checkpoint uses."""
    if origin_hf_dir:
        return Path(origin_hf_dir)
    ckpt_root = located.directory.parent if ITER_RE.match(located.directory.name) or located.directory.name == "release" else load
    for d in (load / ASSETS_DIR, ckpt_root / ASSETS_DIR):
        if (d / "config.json").is_file():
            return d
    found = _run_record_origin([ckpt_root.parent, ckpt_root, load.parent])
    if found is not None:
        record, hf = found
        if (hf / "config.json").is_file():
            return hf
        raise UserError(
            f"{record} says the run started from --hf-checkpoint {hf}, which has no config.json any more; "
            "pass --origin-hf-dir with that model's Hugging Face directory.",
            option="--origin-hf-dir",
        )
    raise UserError(
        f"--load {load} records no Hugging Face config (no {ASSETS_DIR}/config.json and no {RUN_RECORD} of the run "
        "next to it); pass --origin-hf-dir with the Hugging Face model the run started from (its --hf-checkpoint).",
        option="--origin-hf-dir",
    )
