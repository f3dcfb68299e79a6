"""Data options: the prompt dataset, its keys, and the four batch knobs.

One rollout step generates `rollout_batch_size` prompt groups of `n_samples_per_prompt` responses;
the trainer turns them into `num_steps_per_rollout` optimizer steps of `global_batch_size` samples:

    rollout_batch_size × n_samples_per_prompt = global_batch_size × num_steps_per_rollout
"""

from __future__ import annotations

from dataclasses import dataclass

from miles.config.fields import Derived, option


def rollouts_for_epochs(num_prompts: int, num_epoch: int, rollout_batch_size: int) -> int:
    """`--num-rollout` for `--num-epoch`: (dataset size ÷ --rollout-batch-size, rounded down) × epochs,
    at least 1. A step trains on --rollout-batch-size groups, so that is what an epoch is counted in,
    whatever --over-sampling-batch-size draws to make up for groups that dynamic sampling drops
    (upstream miles' rule)."""
    return max(1, (num_prompts // rollout_batch_size) * num_epoch)


def _samples_per_rollout(c) -> int | None:
    if c.data.rollout_batch_size is None:
        return None
    return c.data.rollout_batch_size * c.data.n_samples_per_prompt


@dataclass
class DataConfig:
    prompt_data: str | None = option(None, help="Prompt dataset: a local .jsonl or .parquet file.")
    input_key: str = option("input", help="Key of the prompt in each dataset row.")
    label_key: str | None = option(None, help="Key of the reference answer in each dataset row.")
    metadata_key: str = option("metadata", help="Key of per-row metadata (a dict) passed to rewards and filters.")
    tool_key: str = option("tools", help="Key of the tool specifications passed to the chat template.")
    apply_chat_template: bool = option(False, help="Format prompts with the tokenizer's chat template.")
    apply_chat_template_kwargs: str = option("{}", help="JSON object of extra keyword arguments for the chat template.")
    num_rollout: int | None = option(None, help="Rollout steps to run; replaces a --num-epoch given earlier (e.g. by the recipe).")
    num_epoch: int | None = option(
        None,
        help="Passes over the prompt dataset: sets --num-rollout to (dataset size ÷ --rollout-batch-size, rounded down) × epochs, at least 1; replaces a --num-rollout given earlier (e.g. by the recipe).",
    )
    rollout_batch_size: int | None = option(None, help="Prompt groups per rollout step.")
    n_samples_per_prompt: int = option(1, help="Responses generated per prompt (the group size of GRPO).")
    num_steps_per_rollout: int | None = option(
        help="Optimizer steps per rollout step.",
        derived=Derived(
            "--rollout-batch-size × --n-samples-per-prompt ÷ --global-batch-size when that is set, else 1",
            lambda c: 1 if c.data.global_batch_size is None or _samples_per_rollout(c) is None
            else _samples_per_rollout(c) // c.data.global_batch_size,
        ),
    )
    global_batch_size: int | None = option(
        help="Samples per optimizer step.",
        derived=Derived(
            "--rollout-batch-size × --n-samples-per-prompt ÷ --num-steps-per-rollout",
            lambda c: None if _samples_per_rollout(c) is None else _samples_per_rollout(c) // c.data.num_steps_per_rollout,
        ),
    )
