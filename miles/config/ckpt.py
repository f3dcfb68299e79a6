"""Checkpoint options: where to resume from, where and how often to save, HF exports."""

from __future__ import annotations

from dataclasses import dataclass

from miles.config.fields import Derived, option


@dataclass
class CheckpointConfig:
    load: str | None = option(
        None,
        help="Checkpoint directory to resume from (its latest complete checkpoint); missing or empty = start from --hf-checkpoint.",
    )
    save: str | None = option(None, help="Directory for checkpoints (model, optimizer, RNG, data position, rollout id).")
    save_interval: int | None = option(
        None, help="Save every this many rollout steps; the last step always saves when --save is set."
    )
    save_hf: str | None = option(
        None,
        help="Also export a Hugging Face model at each save, to this path pattern (may contain {rollout_id}).",
    )
    ref_load: str | None = option(
        help="Reference model for the KL terms (a Hugging Face directory).",
        derived=Derived("equal to --hf-checkpoint", lambda c: c.rollout.hf_checkpoint),
    )
    keep_last_checkpoints: int | None = option(
        None, help="Delete older checkpoints, keeping this many complete ones; unset keeps all."
    )
