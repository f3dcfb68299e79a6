"""Reward options (`--rm-type`, `--reward-key`, `--custom-rm-path`, ...): the `cfg.reward` group.

What it is: the declaration of every reward flag as a dataclass field (help and derived rules as data,
see `miles/config/fields.py`) and `RewardConfig.check()`, which rejects unknown reward types and
contradictions with one sentence naming the flag and the fix. What it is not: the reward functions
themselves; those live in `miles/rollout/rm_hub/` and receive this dataclass as their `args`.

Usage:

    cfg = RewardConfig(rm_type="boxed_math")
    cfg.check()                      # raises miles.errors.UserError on a mistake

Nothing heavy is imported here: `miles --help` reads these declarations.
"""

from __future__ import annotations

import dataclasses

from miles.config.fields import Derived, option
from miles.errors import UserError

# The reward types the hub in miles/rollout/rm_hub/ dispatches on. A test checks this tuple against
# the hub's table, so a type cannot be added to one without the other.
KNOWN_RM_TYPES: tuple[str, ...] = (
    "math",
    "dapo",
    "deepscaler",
    "f1",
    "gpqa",
    "exact_match",
    "deterministic_random",
    "random",
    "remote_rm",
)
BOXED_PREFIX = "boxed_"
# Types whose reward says right or wrong (1/0, or dapo's score +1/-1): for these, and only these, eval
# reports an accuracy (`reward > 0`) next to the mean reward. f1 is fractional, and a remote or
# custom reward model may return anything, so their evals report the mean reward alone.
BINARY_RM_TYPES: frozenset[str] = frozenset(
    {"math", "dapo", "deepscaler", "gpqa", "exact_match", "deterministic_random", "random"}
)


def split_rm_type(rm_type: str) -> tuple[bool, str]:
    """`"boxed_math"` -> `(True, "math")`, `"f1"` -> `(False, "f1")`. Whitespace around the name is ignored."""
    name = rm_type.strip()
    if name.startswith(BOXED_PREFIX):
        return True, name[len(BOXED_PREFIX) :]
    return False, name


def unknown_rm_type_message(rm_type: str, where: str) -> str:
    known = ", ".join(KNOWN_RM_TYPES)
    return (
        f"{where} {rm_type!r} is not a known reward type; use one of {known} "
        f"(any of them may take the {BOXED_PREFIX!r} prefix) or give --custom-rm-path."
    )


@dataclasses.dataclass
class RewardConfig:
    """How each sample's reward is computed (`cfg.reward`)."""

    rm_type: str | None = option(
        None,
        help=(
            "Reward type: " + ", ".join(KNOWN_RM_TYPES) + "; the prefix boxed_ (e.g. boxed_math) scores only "
            "the content of the last \\boxed{} of the response. A sample's metadata['rm_type'] overrides it."
        ),
    )
    math_free_text_fallback: bool = option(
        False,
        help=(
            "--rm-type math: grade a response that has no closed \\boxed{} on the answer math-verify finds in "
            "its free text. Off (upstream's rule): such a response scores 0, which teaches the model to finish "
            "and box its answer; a truncated response no longer earns a reward for a number it mentioned."
        ),
    )
    reward_key: str | None = option(
        None, help="When rewards are dicts (dapo, remote or custom reward models), the key to train on."
    )
    eval_reward_key: str | None = option(
        help="The key of a dict reward reported by evaluation.",
        derived=Derived("equal to --reward-key", lambda c: c.reward.reward_key),
    )
    group_rm: bool = option(
        False, help="Compute the rewards of a prompt group in one call (a batched --custom-rm-path fn(args, samples))."
    )
    rm_url: str | None = option(
        None, help="URL that --rm-type remote_rm POSTs {prompt, response, label} to as JSON; it answers a number or a dict."
    )
    rm_timeout: float = option(30.0, help="Seconds to wait for one answer of the remote reward model (--rm-url).")
    rm_max_retries: int = option(
        3, help="Retries of a failed remote reward request (timeout, connection error, HTTP 5xx/429) before giving up."
    )
    custom_rm_path: str | None = option(
        None,
        help=(
            "Your reward function, module.fn or file.py:fn: async fn(args, sample) -> float | dict, or with "
            "--group-rm async fn(args, samples) -> list; args is this reward configuration. Overrides --rm-type."
        ),
    )
    custom_reward_post_process_path: str | None = option(
        None,
        help="fn(args, samples) -> (raw_rewards, rewards) replacing the group normalisation of rewards before advantages.",
    )
    custom_convert_samples_to_train_data_path: str | None = option(
        None, help="fn(args, samples) -> dict replacing the whole conversion of samples into train data."
    )

    def check(self) -> None:
        """Reject reward options that cannot work, naming the flag and the fix."""
        if self.rm_type is not None:
            boxed, base = split_rm_type(self.rm_type)
            if base not in KNOWN_RM_TYPES:
                raise UserError(unknown_rm_type_message(self.rm_type, "--rm-type"), option="--rm-type")
            if base == "remote_rm" and not self.rm_url and not self.custom_rm_path:
                raise UserError(
                    f"--rm-type {self.rm_type} needs --rm-url, the address of the reward server (e.g. http://127.0.0.1:8000/reward).",
                    option="--rm-url",
                )
            if base == "dapo" and self.reward_key is None and not self.custom_rm_path:
                raise UserError(
                    f"--rm-type {self.rm_type} gives dict rewards {{score, acc, pred}}; add --reward-key score to train on the score.",
                    option="--reward-key",
                )
        if self.math_free_text_fallback and (self.custom_rm_path or (self.rm_type or "").strip() != "math"):
            raise UserError(
                "--math-free-text-fallback changes only --rm-type math (without the boxed_ prefix and without "
                "--custom-rm-path); drop it or use --rm-type math.",
                option="--math-free-text-fallback",
            )
        if self.rm_url is not None and not self.rm_url.startswith(("http://", "https://")):
            raise UserError(f"--rm-url {self.rm_url!r} must start with http:// or https://.", option="--rm-url")
        if not self.rm_timeout > 0:
            raise UserError(f"--rm-timeout {self.rm_timeout} must be a positive number of seconds.", option="--rm-timeout")
        if self.rm_max_retries < 0:
            raise UserError(f"--rm-max-retries {self.rm_max_retries} must be 0 or more.", option="--rm-max-retries")
