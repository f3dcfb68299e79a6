"""What a rule-based scorer of the reward hub receives: `RewardInput`.

Scorers are plain synchronous functions `score(inp: RewardInput) -> float | dict`; the hub
(`miles/rollout/rm_hub/__init__.py`) builds the input, applies the `boxed_` prefix and awaits
nothing on their behalf, so each scorer is testable with a string and a label.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from miles.errors import UserError
from miles.sample import Sample


@dataclasses.dataclass(frozen=True)
class RewardInput:
    response: str
    """The text to score: the whole response, or only the last box's content under the boxed_ prefix."""
    label: Any
    metadata: dict[str, Any]
    sample: Sample
    rm_type: str
    """The effective reward type, as written (e.g. "boxed_math"), for error messages."""
    answer_only: bool = False
    """True when `response` is already a bare answer (the boxed_ prefix extracted it)."""
    free_text_fallback: bool = False
    """`--math-free-text-fallback`: `math` grades a response without a closed box on its free text."""

    def label_text(self) -> str:
        """The label as text; a missing label is a data error, not a wrong answer."""
        if self.label is None:
            raise UserError(
                f"reward type {self.rm_type!r} compares with a label, but sample {self.sample.index} has none; "
                "set --label-key to the data column holding the reference answer.",
                option="--label-key",
            )
        return str(self.label)
