"""The reward hub: turn a generated `Sample` into its reward, by `--rm-type` or `--custom-rm-path`.

Public API (both coroutines; `cfg` is the `RewardConfig`, i.e. `cfg.reward` of the engine config):

    reward = await compute_reward(cfg, sample)              # float, or dict for dict-valued types
    rewards = await compute_group_rewards(cfg, group)       # list, one per sample, in order

Which function scores a sample, first match wins:

1. `--custom-rm-path` (module.fn or file.py:fn): `async fn(args, sample)`; with `--group-rm`,
   `compute_group_rewards` calls `async fn(args, samples)` once per group instead and expects a list
   of the same length. `args` is the `RewardConfig` (its `rm_type`, `reward_key`, `rm_url`, ...).
   A plain (non-async) function is accepted too.
2. `sample.metadata["rm_type"]`, so one dataset can mix tasks.
3. `--rm-type`.

A type may carry the prefix `boxed_` (e.g. `boxed_math`, `boxed_exact_match`): the scorer then sees
only the content of the response's last `\\boxed{}` (an empty string when there is none).
The scorers, each in its own module: `math`/`deepscaler` (math_rm.py), `dapo` (dapo.py), `f1`
(f1.py), `gpqa` (gpqa.py), `exact_match`/`deterministic_random`/`random` (simple.py), `remote_rm`
(remote.py). Rule-based scorers are synchronous and cheap enough to run on the event loop.

Rewards are returned, not written into the sample: the caller decides where they go.
`--reward-key` (picking an entry of a dict reward) and `--custom-reward-post-process-path` are
applied later, by the conversion of samples into train data.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
from typing import Any, Callable

from miles.config.reward import KNOWN_RM_TYPES, RewardConfig, split_rm_type, unknown_rm_type_message
from miles.errors import UserError
from miles.rollout.rm_hub.boxed import last_boxed_content
from miles.rollout.rm_hub.dapo import dapo_reward
from miles.rollout.rm_hub.f1 import f1_reward
from miles.rollout.rm_hub.gpqa import gpqa_reward
from miles.rollout.rm_hub.math_rm import deepscaler_reward, math_reward
from miles.rollout.rm_hub.remote import RemoteRewardError, remote_reward
from miles.rollout.rm_hub.simple import deterministic_random_reward, exact_match_reward, random_reward
from miles.rollout.rm_hub.types import RewardInput
from miles.sample import Sample
from miles.utils.load_function import load_function

__all__ = ["compute_reward", "compute_group_rewards", "effective_rm_type", "RewardInput", "RemoteRewardError", "SCORERS"]

Reward = float | dict[str, Any]

SCORERS: dict[str, Callable[[RewardInput], Reward]] = {
    "math": math_reward,
    "dapo": dapo_reward,
    "deepscaler": deepscaler_reward,
    "f1": f1_reward,
    "gpqa": gpqa_reward,
    "exact_match": exact_match_reward,
    "deterministic_random": deterministic_random_reward,
    "random": random_reward,
}
_ASYNC_TYPES = ("remote_rm",)
assert set(SCORERS) | set(_ASYNC_TYPES) == set(KNOWN_RM_TYPES), "rm_hub and miles.config.reward disagree on the types"


def effective_rm_type(cfg: RewardConfig, sample: Sample) -> str:
    """The reward type that applies to `sample`: its metadata's "rm_type", else --rm-type."""
    override = sample.metadata.get("rm_type") if isinstance(sample.metadata, dict) else None
    rm_type = (override or cfg.rm_type or "").strip()
    if not rm_type:
        raise UserError(
            "no reward type is set; give --rm-type (e.g. math, exact_match) or --custom-rm-path.", option="--rm-type"
        )
    if split_rm_type(rm_type)[1] not in KNOWN_RM_TYPES:
        where = f"sample {sample.index} metadata['rm_type']" if override else "--rm-type"
        raise UserError(unknown_rm_type_message(rm_type, where), option="--rm-type")
    return rm_type


@functools.lru_cache(maxsize=None)
def _custom_rm(path: str | None) -> Callable[..., Any] | None:
    # Loaded once per path: a file.py hook would otherwise be re-executed (its globals reset) per sample.
    return load_function(path, flag="--custom-rm-path")


async def _maybe_await(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value


async def compute_reward(cfg: RewardConfig, sample: Sample) -> Reward:
    """The reward of one sample; see the module docstring for which function computes it."""
    custom = _custom_rm(cfg.custom_rm_path)
    if custom is not None:
        return await _maybe_await(custom(cfg, sample))
    rm_type = effective_rm_type(cfg, sample)
    boxed, base = split_rm_type(rm_type)
    response = sample.response or ""
    if boxed:
        response = last_boxed_content(response) or ""
    inp = RewardInput(
        response=response,
        label=sample.label,
        metadata=sample.metadata if isinstance(sample.metadata, dict) else {},
        sample=sample,
        rm_type=rm_type,
        answer_only=boxed,
        free_text_fallback=cfg.math_free_text_fallback,
    )
    if base == "remote_rm":
        return await remote_reward(cfg, inp)
    return SCORERS[base](inp)


async def compute_group_rewards(cfg: RewardConfig, samples: list[Sample]) -> list[Reward]:
    """The rewards of a prompt group, in order: one batched custom call with --group-rm, else one per sample."""
    if cfg.group_rm and cfg.custom_rm_path:
        custom = _custom_rm(cfg.custom_rm_path)
        rewards = await _maybe_await(custom(cfg, samples))
        if not isinstance(rewards, (list, tuple)) or len(rewards) != len(samples):
            got = f"{len(rewards)} rewards" if isinstance(rewards, (list, tuple)) else type(rewards).__name__
            raise UserError(
                f"--custom-rm-path {cfg.custom_rm_path} with --group-rm must return a list of {len(samples)} "
                f"rewards (one per sample of the group) but returned {got}.",
                option="--custom-rm-path",
            )
        return list(rewards)
    return list(await asyncio.gather(*(compute_reward(cfg, s) for s in samples)))
