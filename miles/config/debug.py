"""Debug options: checks and dumps that make a run inspectable."""

from __future__ import annotations

from dataclasses import dataclass

from miles.config.fields import option


@dataclass
class DebugConfig:
    check_weight_update_equal: bool = option(
        False,
        help="After every weight sync, compare the rollout engines' weights with the trainer's and stop on any difference.",
    )
    save_debug_rollout_data: str | None = option(
        None, help="Write each rollout's samples to this path pattern (JSONL; may contain {rollout_id})."
    )
    debug_rollout_only: bool = option(
        False,
        help="Generate and score rollouts but never train (weights stay fixed); checkpoints still record the data position.",
    )
