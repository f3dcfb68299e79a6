"""The metric names the training loop emits, with their meaning: part of miles' interface.

Names are `/`-separated with four prefixes: `rollout/` (the generated batch), `train/` (the
optimizer steps on it), `eval/<dataset>/` (one block per `--eval-prompt-data` dataset), `perf/`
(wall-clock seconds and throughput). Every metric is logged with the step = the number of completed
rollouts (eval before training is step 0). A `<placeholder>` segment stands for a family of names
(`eval/<ds>/accuracy` covers `eval/gsm8k/accuracy`).

`metric_names()` is the table; `metric_names_markdown()` renders it into docs/monitoring.md (a test
checks the doc block equals it); `is_documented(name)` tells whether a concrete name is covered.
Regenerate the doc block with `python -m miles.tracking.metric_names --write docs/monitoring.md`.
The `train/` names are the loss metrics of miles/algo/losses.py (and miles/algo/rollout_correction.py)
under the `train/` prefix, plus what the trainer adds.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

_NAMES: tuple[tuple[str, str], ...] = (
    # rollout/: the batch generated at this step (all samples of all groups)
    ("rollout/raw_reward", "Mean reward of the step's samples, before any normalisation."),
    ("rollout/reward_std", "Standard deviation of the step's rewards (population, over all samples)."),
    ("rollout/response_len_mean", "Mean response length in tokens."),
    ("rollout/truncated_ratio", "Fraction of samples cut by the response-length limit."),
    ("rollout/zero_std_fraction", "Fraction of prompt groups whose rewards are all equal (zero advantage under GRPO)."),
    ("rollout/dynamic_filter/drop_<reason>", "Number of groups dynamic sampling dropped for `<reason>` at this step (upstream miles' name)."),
    ("rollout/num_turns", "Multi-turn and agentic generation: mean engine calls per sample."),
    ("rollout/tool_call_rate", "Multi-turn and agentic generation: fraction of samples that called a tool at least once."),
    ("rollout/tool_error_rate", "Multi-turn generation: fraction of tool calls answered with an error (invalid JSON, unknown tool, failure, timeout)."),
    ("rollout/aborted_groups", "Groups still generating when enough were kept: aborted and given back to the data source (drawn first next step)."),
    ("rollout/weight_staleness_mean", "Mean over the step's samples of the updates their oldest token lags the trainer (--train-async, --fully-async, --partial-rollout only; 1 under --train-async)."),
    ("rollout/weight_staleness_max", "Largest such lag of the step (never above --max-weight-staleness under --fully-async)."),
    ("rollout/stale_groups_regenerated", "--fully-async: buffered groups older than --max-weight-staleness, sent back to be generated again."),
    ("rollout/async_aborted_groups_regenerated", "--fully-async: groups a weight update aborted in flight, sent back to be generated again."),
    ("rollout/async_buffer_groups", "--fully-async: generated groups left in the buffer after this step took its own."),
    ("rollout/partial_aborted_samples", "--partial-rollout: samples given back with a partial response when enough groups were kept."),
    ("rollout/partial_continued_samples", "--partial-rollout: samples of this step that continued a partial response."),
    ("rollout/engine_restarts", "Engine servers restarted by fault tolerance since the run started (only with --rollout-num-gpus)."),
    ("rollout/requeued_requests", "Requests sent again because their engine server died under them, since the run started (only with --rollout-num-gpus)."),
    ("rollout/teacher_log_probs", "--use-opd --opd-type sglang: mean teacher log-prob of the response tokens, scored by the engine at --opd-teacher-urls."),
    # train/: the optimizer steps on this rollout (means over the steps unless said otherwise)
    ("train/loss", "The loss that was back-propagated (policy loss − entropy bonus + KL loss)."),
    ("train/pg_loss", "PPO clipped surrogate (GSPO: with the sequence-level ratio)."),
    ("train/pg_clipfrac", "Fraction of tokens where the clipped term of the surrogate was taken."),
    ("train/ppo_kl", "Mean of old log-prob − new log-prob (GSPO: per-sample mean)."),
    ("train/approx_kl", "k3 estimate of KL(old ‖ new)."),
    ("train/ratio_mean", "Mean PPO ratio exp(logp − old_logp)."),
    ("train/ratio_max", "Largest PPO ratio of the rollout (max over the optimizer steps)."),
    ("train/ratio_min", "Smallest PPO ratio of the rollout (min over the optimizer steps)."),
    ("train/entropy_loss", "Mean token entropy of the policy (0 when entropy is not computed)."),
    ("train/kl_loss", "Mean KL to the reference model (`--kl-loss-type`), with `--use-kl-loss`."),
    ("train/train_rollout_logprob_abs_diff", "Mean |trainer log-prob − rollout-engine log-prob| (engine mismatch)."),
    ("train/train_rollout_kl", "Mean low-variance KL between rollout-engine and trainer log-probs."),
    ("train/opd_reverse_kl", "--use-opd: mean of student log-prob − teacher log-prob over trained tokens (the reverse KL to the teacher, from the log-probs before the update)."),
    ("train/tis", "Mean truncated importance-sampling weight, with `--use-tis`."),
    ("train/tis_clipfrac", "Fraction of tokens whose TIS weight was truncated."),
    ("train/tis_abs", "Mean |TIS weight − 1|."),
    ("train/mis_<metric>", "Rollout-correction metrics of `--custom-config-path` MIS (weights, mask fractions)."),
    ("train/grad_norm", "Gradient norm before clipping (mean over the optimizer steps)."),
    ("train/lr", "Learning rate of the last optimizer step."),
    ("train/skipped_step", "Fraction of optimizer steps skipped (non-finite gradient)."),
    # critic/: PPO's critic (--advantage-estimator ppo), its own train group (miles.train.step.train_critic)
    ("critic/loss", "The critic's loss (equal to critic/value_loss)."),
    ("critic/value_loss", "Clipped value loss max((V - R)^2, (V_old + clip(V - V_old, ±value_clip) - R)^2), mean over the optimizer steps."),
    ("critic/value_clipfrac", "Fraction of trained tokens with |V - V_old| > --value-clip."),
    ("critic/explained_variance", "1 - Var(R - V) / Var(R) of the critic's values before the update against the GAE returns, over the rollout's trained tokens (0 when every return is equal)."),
    ("critic/value_mean", "Mean critic value over the rollout's trained tokens, before the update."),
    ("critic/grad_norm", "The critic's gradient norm before clipping (mean over the optimizer steps)."),
    ("critic/lr", "The critic's learning rate at its last optimizer step (--critic-lr, --critic-lr-warmup-iters)."),
    ("critic/skipped_step", "Fraction of the critic's optimizer steps skipped (non-finite gradient)."),
    ("perf/critic_train_time", "Seconds the critic's ranks spent in their train call (inside perf/train_time)."),
    ("train/trainable_params", "Parameters the optimizer trains (with LoRA: the adapters'), each tensor once."),
    ("train/total_params", "Parameters of the trained model, adapters included, each tensor once."),
    ("train/trainable_share", "train/trainable_params / train/total_params (1 for full fine-tuning)."),
    ("train/optimizer_state_bytes", "Bytes of optimizer (AdamW) state on the source training rank."),
    # eval/<ds>/: one block per eval dataset, on the eval sampling settings
    ("eval/<ds>/accuracy", "Fraction of eval samples with a positive reward; only for right/wrong reward types (math, dapo, deepscaler, gpqa, exact_match, random, deterministic_random), not for f1, remote_rm or --custom-rm-path."),
    ("eval/<ds>/reward", "Mean eval reward (always reported)."),
    ("eval/<ds>/response_len_mean", "Mean eval response length in tokens."),
    ("eval/<ds>/num_turns", "Multi-turn and agentic generation: mean engine calls per eval sample."),
    ("eval/<ds>/tool_call_rate", "Multi-turn and agentic generation: fraction of eval samples that called a tool."),
    ("eval/<ds>/tool_error_rate", "Multi-turn generation: fraction of eval tool calls answered with an error."),
    ("eval/<ds>/truncated_ratio", "Fraction of eval samples cut by `--eval-max-response-len`."),
    # perf/: seconds and throughput
    ("perf/step_time", "Wall-clock seconds of the whole step (generate, train, save, sync, eval)."),
    ("perf/rollout_time", "Seconds spent generating and scoring the rollout."),
    ("perf/opd_teacher_time", "--use-opd --opd-type sglang: seconds the teacher engine took to score the rollout (inside perf/rollout_time)."),
    ("perf/train_time", "Seconds the driver waited for training on the rollout."),
    ("perf/train_step_time", "Seconds the trainer spent in its train call (inside perf/train_time)."),
    ("perf/trainer_idle_time", "Seconds between the end of the previous train call and the start of this one (what the trainer waited for)."),
    ("perf/weight_sync_time", "Seconds to send the new weights to the rollout engines."),
    ("perf/weight_sync_bytes", "Bytes of weights the trainer's source rank sent to the rollout engines at this step's weight update."),
    ("perf/weight_sync_send_time", "Seconds the trainer's source rank spent sending them (inside perf/weight_sync_time)."),
    ("perf/eval_time", "Seconds spent on eval (all datasets) at this step."),
    ("perf/rollout_tokens_per_s", "Generated tokens per second during the rollout."),
    ("perf/train_tokens_per_s", "Trained tokens (prompt + response) per second, all data-parallel ranks."),
)

PREFIXES = ("rollout/", "train/", "critic/", "eval/", "perf/")


def metric_names() -> list[tuple[str, str]]:
    """(name, meaning) for every documented metric, grouped by prefix."""
    return list(_NAMES)


def _pattern(name: str) -> re.Pattern[str]:
    parts = re.split(r"(<[a-z_]+>)", name)
    body = "".join("[^/]+" if p.startswith("<") else re.escape(p) for p in parts)
    return re.compile(body + r"\Z")


_PATTERNS = [_pattern(name) for name, _ in _NAMES]


def is_documented(name: str) -> bool:
    """True when `name` (a concrete key such as `eval/gsm8k/accuracy`) is in the table."""
    return any(p.match(name) for p in _PATTERNS)


def metric_names_markdown() -> str:
    """The metric-names table of docs/monitoring.md (between its `metric-names` GENERATED markers)."""
    rows = ["| Metric | Meaning |", "|---|---|"]
    for name, meaning in _NAMES:
        escaped = meaning.replace("|", "\\|")  # a `|` would end the table cell
        rows.append(f"| `{name}` | {escaped} |")
    return "\n".join(rows) + "\n"


BEGIN = "<!-- BEGIN GENERATED: metric-names -->\n"
END = "<!-- END GENERATED: metric-names -->"


def replace_block(doc: str) -> str:
    """`doc` with the text between the metric-names markers replaced by `metric_names_markdown()`."""
    start, end = doc.index(BEGIN) + len(BEGIN), doc.index(END)
    return doc[:start] + metric_names_markdown() + doc[end:]


if __name__ == "__main__":
    if sys.argv[1:2] == ["--write"] and len(sys.argv) == 3:
        path = Path(sys.argv[2])
        path.write_text(replace_block(path.read_text(encoding="utf-8")), encoding="utf-8")
    else:
        sys.stdout.write(metric_names_markdown())
