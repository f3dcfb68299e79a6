"""`Sample`: one prompt's one response, the object that flows from rollout to rewards to training.

Field names follow upstream miles, so custom functions (`--custom-rm-path`,
`--custom-generate-function-path`, filters) written for it read the same attributes.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any


class SampleStatus(str, enum.Enum):
    PENDING = "pending"
    COMPLETED = "completed"
    TRUNCATED = "truncated"  # stopped by the max-new-tokens / context limit, not by a stop condition
    ABORTED = "aborted"


@dataclasses.dataclass
class Sample:
    """One response to one prompt, with everything training needs from it."""

    prompt: str | list[dict[str, Any]] = ""
    """The prompt as text or chat messages (before the chat template)."""
    tokens: list[int] = dataclasses.field(default_factory=list)
    """Prompt token ids followed by response token ids."""
    response: str = ""
    response_length: int = 0
    """Number of response tokens at the end of `tokens`."""
    label: Any = None
    reward: float | dict[str, Any] | None = None
    loss_mask: list[int] | None = None
    """Per response token: 1 = trained on, 0 = ignored (e.g. tool output). None means all ones."""
    rollout_log_probs: list[float] | None = None
    """Per response token log-probability under the rollout engine's weights."""
    metadata: dict[str, Any] = dataclasses.field(default_factory=dict)
    tools: Any = None
    status: SampleStatus = SampleStatus.PENDING
    weight_version: int | None = None
    """Version of the weights that generated the response (the rollout id after which they were synced)."""
    weight_versions: list[int] | None = None
    """Per response token: the weight version that produced it (several after a partial rollout's continuation)."""
    group_index: int | None = None
    """Which prompt group of the rollout batch this sample belongs to."""
    index: int | None = None
    """Index within the whole rollout (group_index * n_samples_per_prompt + position in the group)."""

    @property
    def prompt_length(self) -> int:
        return len(self.tokens) - self.response_length

    @property
    def response_tokens(self) -> list[int]:
        return self.tokens[len(self.tokens) - self.response_length :]

    def oldest_weight_version(self) -> int | None:
        """The oldest weight version among the response's tokens; `weight_version` when only that is recorded
        (a generate function that sets the version of the request that finished the response); None when neither."""
        versions = [v for v in self.weight_versions or [] if v is not None]
        return min(versions) if versions else self.weight_version

    def effective_loss_mask(self) -> list[int]:
        return self.loss_mask if self.loss_mask is not None else [1] * self.response_length

    def get_reward_value(self, reward_key: str | None = None) -> float:
        """The scalar reward; with a dict reward, `reward_key` (--reward-key) picks the entry."""
        if isinstance(self.reward, dict):
            if reward_key is None:
                raise KeyError("the reward is a dict; set --reward-key to choose the entry to train on")
            return float(self.reward[reward_key])
        if self.reward is None:
            raise ValueError("sample has no reward yet")
        return float(self.reward)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["status"] = self.status.value
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Sample":
        d = dict(d)
        d["status"] = SampleStatus(d.get("status", "pending"))
        return cls(**d)
