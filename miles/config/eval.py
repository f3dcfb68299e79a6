"""Evaluation options: held-out datasets, how often, and how eval sampling differs from rollout."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from miles.config.fields import Derived, option


@dataclass
class EvalConfig:
    eval_interval: int | None = option(None, help="Evaluate every this many rollout steps (and after the last); unset = never.")
    eval_prompt_data: list[str] | None = option(
        None,
        help="Eval datasets as NAME PATH pairs: repeat the flag per value (--eval-prompt-data arith --eval-prompt-data eval.jsonl), or give the pairs in --extra-args.",
        in_eval=True,
    )
    skip_eval_before_train: bool = option(False, help="Do not evaluate before the first training step.")
    eval_input_key: str | None = option(
        help="Key of the prompt in eval rows.", derived=Derived("equal to --input-key", lambda c: c.data.input_key),
        in_eval=True,
    )
    eval_label_key: str | None = option(
        help="Key of the reference answer in eval rows.", derived=Derived("equal to --label-key", lambda c: c.data.label_key),
        in_eval=True,
    )
    n_samples_per_eval_prompt: int = option(1, help="Responses generated per eval prompt.", in_eval=True)
    eval_temperature: float | None = option(
        help="Sampling temperature for eval (0 = greedy).",
        derived=Derived("equal to --rollout-temperature", lambda c: c.rollout.rollout_temperature),
        in_eval=True,
    )
    eval_top_p: float | None = option(
        help="Nucleus sampling for eval.", derived=Derived("equal to --rollout-top-p", lambda c: c.rollout.rollout_top_p),
        in_eval=True,
    )
    eval_top_k: int | None = option(
        help="Top-k sampling for eval.", derived=Derived("equal to --rollout-top-k", lambda c: c.rollout.rollout_top_k),
        in_eval=True,
    )
    eval_max_response_len: int | None = option(
        help="Maximum new tokens per eval response.",
        derived=Derived("equal to --rollout-max-response-len", lambda c: c.rollout.rollout_max_response_len),
        in_eval=True,
    )
    eval_num_gpus: int = option(
        0,
        help="Devices for a dedicated eval fleet that evaluates exported snapshots while training goes on; 0 = evaluate on the rollout engines.",
        unsupported="a dedicated eval fleet is not built yet; eval runs on the rollout engines",
    )
    eval_max_in_flight: int = option(
        2,
        help="Snapshot evals allowed to be pending at once (dedicated eval fleet).",
        unsupported="it applies to the dedicated eval fleet (--eval-num-gpus > 0), which is not built yet",
    )
    eval_overflow_policy: Literal["backpressure", "skip"] = option(
        "backpressure",
        help="When --eval-max-in-flight evals are pending: backpressure waits for the oldest, skip logs eval/skipped_busy.",
        unsupported="it applies to the dedicated eval fleet (--eval-num-gpus > 0), which is not built yet",
    )
