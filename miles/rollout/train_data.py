"""Turn one rollout's samples into the train data the trainer consumes (upstream's train-data conversion).

`samples_to_train_data(samples, algo=..., n_samples_per_prompt=..., reward_key=...)` returns a dict of
per-sample lists (plain python values, so it travels through Ray's object store unchanged):

- `tokens` (prompt + response ids), `response_lengths`, `sample_indices` (`Sample.index`);
- `raw_reward`: the scalar reward (`--reward-key` picks the entry of a dict reward);
- `rewards`: what the advantage estimator sees. For grpo, gspo and reinforce_plus_plus_baseline the
  raw rewards are normalised within each prompt group (`miles.algo.advantages.normalize_group_rewards`):
  the group mean is subtracted and, for grpo/gspo, the result is divided by the group std + 1e-6,
  unless `--disable-grpo-std-normalization` or the group has one sample. `--disable-rewards-normalization`
  keeps raw rewards. A custom post-process (`--custom-reward-post-process-path`, called
  `fn(args, samples) -> (raw_rewards, rewards)`) replaces all of this;
- `truncated`: 1 when the response hit the length limit, else 0;
- `loss_masks`: per response token 0/1 (all ones when the sample has none);
- `rollout_log_probs`: present when the samples carry the engine's per-token log-probs.

Groups are the samples sharing `Sample.group_index` when every sample has one (groups may then differ
in size, e.g. after dynamic-sampling filters), else consecutive runs of `n_samples_per_prompt`.
A custom converter (`--custom-convert-samples-to-train-data-path`, `fn(args, samples) -> dict`)
replaces the whole function. Hooks receive `hook_args` (default: the `AlgoConfig`) as `args`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from miles.algo.advantages import normalize_group_rewards
from miles.config.algo import GROUP_BASELINE_ESTIMATORS, STD_NORMALIZED_ESTIMATORS, AlgoConfig
from miles.errors import UserError
from miles.sample import Sample, SampleStatus


def samples_to_train_data(
    samples: list[Sample],
    *,
    algo: AlgoConfig,
    n_samples_per_prompt: int,
    reward_key: str | None,
    custom_reward_post_process: Callable[[Any, list[Sample]], tuple[list[float], list[float]]] | None = None,
    custom_convert: Callable[[Any, list[Sample]], dict[str, Any]] | None = None,
    hook_args: Any = None,
) -> dict[str, Any]:
    """Build the train-data dict described in the module docstring."""
    args = algo if hook_args is None else hook_args
    if custom_convert is not None:
        return custom_convert(args, samples)
    if not samples:
        raise ValueError("samples_to_train_data got no samples")

    if custom_reward_post_process is not None:
        raw_rewards, rewards = custom_reward_post_process(args, samples)
        raw_rewards, rewards = [float(r) for r in raw_rewards], [float(r) for r in rewards]
        if not len(raw_rewards) == len(rewards) == len(samples):
            raise ValueError(
                f"--custom-reward-post-process-path returned {len(raw_rewards)} raw and {len(rewards)} rewards for {len(samples)} samples"
            )
    else:
        raw_rewards = [_reward_value(s, reward_key) for s in samples]
        rewards = normalize_rewards(raw_rewards, _groups(samples, n_samples_per_prompt), algo)

    loss_masks: list[list[int]] = []
    for s in samples:
        mask = list(s.effective_loss_mask())
        if len(mask) != s.response_length:
            raise ValueError(f"sample {s.index}: loss mask has {len(mask)} entries for {s.response_length} response tokens")
        loss_masks.append(mask)

    data: dict[str, Any] = {
        "tokens": [list(s.tokens) for s in samples],
        "response_lengths": [s.response_length for s in samples],
        "rewards": rewards,
        "raw_reward": raw_rewards,
        "truncated": [1 if s.status == SampleStatus.TRUNCATED else 0 for s in samples],
        "loss_masks": loss_masks,
        "sample_indices": [s.index for s in samples],
    }
    if any(s.rollout_log_probs is not None for s in samples):
        lps = []
        for s in samples:
            if s.rollout_log_probs is None or len(s.rollout_log_probs) != s.response_length:
                got = None if s.rollout_log_probs is None else len(s.rollout_log_probs)
                raise ValueError(f"sample {s.index}: {got} rollout log-probs for {s.response_length} response tokens")
            lps.append([float(x) for x in s.rollout_log_probs])
        data["rollout_log_probs"] = lps
    return data


def normalize_rewards(raw_rewards: list[float], groups: list[list[int]], algo: AlgoConfig) -> list[float]:
    """Group-normalise `raw_rewards` for the estimators that use a group baseline; else return them."""
    if algo.advantage_estimator not in GROUP_BASELINE_ESTIMATORS or algo.disable_rewards_normalization:
        return list(raw_rewards)
    std = algo.advantage_estimator in STD_NORMALIZED_ESTIMATORS and not algo.disable_grpo_std_normalization
    rewards = torch.tensor(raw_rewards, dtype=torch.float32)
    sizes = {len(idx) for idx in groups}
    if len(sizes) == 1:  # equal groups (the usual case): one call over all of them, not one per group
        n = sizes.pop()
        order = torch.tensor([i for idx in groups for i in idx], dtype=torch.long)
        out = torch.empty_like(rewards)
        out[order] = normalize_group_rewards(rewards[order], n, std_normalization=std)
        return out.tolist()
    out = torch.empty_like(rewards)
    for idx in groups:
        ix = torch.tensor(idx, dtype=torch.long)
        out[ix] = normalize_group_rewards(rewards[ix], len(idx), std_normalization=std)
    return out.tolist()


def _groups(samples: list[Sample], n_samples_per_prompt: int) -> list[list[int]]:
    """Indices of each prompt group: by `group_index` when all samples have one, else consecutive runs."""
    if all(s.group_index is not None for s in samples):
        by_group: dict[int, list[int]] = {}
        for i, s in enumerate(samples):
            by_group.setdefault(s.group_index, []).append(i)
        return list(by_group.values())
    if len(samples) % n_samples_per_prompt:
        raise ValueError(
            f"{len(samples)} samples without group_index do not split into groups of --n-samples-per-prompt {n_samples_per_prompt}"
        )
    return [list(range(i, i + n_samples_per_prompt)) for i in range(0, len(samples), n_samples_per_prompt)]


def _reward_value(sample: Sample, reward_key: str | None) -> float:
    if isinstance(sample.reward, dict):
        if reward_key is None:
            raise UserError(
                f"the reward is a dict with keys {sorted(sample.reward)}; set --reward-key to the one to train on.",
                option="--reward-key",
            )
        if reward_key not in sample.reward:
            raise UserError(
                f"--reward-key {reward_key!r} is not in the reward dict (keys: {sorted(sample.reward)}); pick one of them.",
                option="--reward-key",
            )
    return sample.get_reward_value(reward_key)
