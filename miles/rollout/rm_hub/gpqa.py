"""`gpqa` reward: did the model pick the right option letter of a multiple-choice question?

The correct letter is `metadata["correct_letter"]`, else the label when it is a letter, an option
index (0 = A), or the text of one of `metadata["choices"]`. Valid letters are
`metadata["valid_letters"]`, else one per choice, else A-D. The chosen letter is read from the
response after its last `</think>`, trying in order: the last `\\boxed{X}`, the last
"answer is X" / "answer: (X)" / "option X" phrase, a last line that is only "X" or "(X)", the last
"(X)". An article "A" in running text is therefore never taken as an answer. Score 1.0 or 0.0.
"""

from __future__ import annotations

import re
import string
from typing import Any

from miles.errors import UserError
from miles.rollout.rm_hub.boxed import last_boxed_content
from miles.rollout.rm_hub.types import RewardInput

_DEFAULT_LETTERS = "ABCD"
# The keyword is case-insensitive, the letter is not: "the answer is a prime" names no option.
_PHRASE = re.compile(r"(?i:answer|option|choice)\s*(?i:is|:)?\s*(?i:option\s*)?[\(\[]?\s*(?:\\text\{)?([A-Z])\b")
_LONE_LETTER = re.compile(r"\(?\s*([A-Z])\s*\)?\.?")
_PAREN_LETTER = re.compile(r"\(([A-Z])\)")


def _valid_letters(metadata: dict[str, Any]) -> str:
    if metadata.get("valid_letters"):
        return "".join(str(x).strip().upper() for x in metadata["valid_letters"])
    if metadata.get("choices"):
        return string.ascii_uppercase[: len(metadata["choices"])]
    return _DEFAULT_LETTERS


def correct_letter(inp: RewardInput, valid: str) -> str:
    given = inp.metadata.get("correct_letter")
    if isinstance(given, str) and given.strip():
        return given.strip().upper()
    label = inp.label
    if isinstance(label, int) and not isinstance(label, bool) and 0 <= label < len(valid):
        return valid[label]
    if isinstance(label, str):
        text = label.strip()
        if len(text) == 1 and text.upper() in valid:
            return text.upper()
        choices = inp.metadata.get("choices") or []
        for letter, choice in zip(valid, choices):
            if str(choice).strip().lower() == text.lower():
                return letter
    raise UserError(
        f"gpqa reward: cannot tell the correct option of sample {inp.sample.index} from label {label!r}; "
        "give the letter (or the 0-based option index) as the label, or metadata['correct_letter'].",
        option="--label-key",
    )


def chosen_letter(response: str, valid: str) -> str | None:
    """The option letter the response commits to, or None."""
    text = response.rsplit("</think>", 1)[-1]
    boxed = last_boxed_content(text)
    if boxed is not None:
        inner = re.sub(r"\\text\{([^{}]*)\}", r"\1", boxed).strip().strip("()").strip().upper()
        if len(inner) == 1 and inner in valid:
            return inner
    hits = [h for h in _PHRASE.findall(text) if h in valid]
    if hits:
        return hits[-1]
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    if lines:
        lone = _LONE_LETTER.fullmatch(lines[-1])
        if lone and lone.group(1) in valid:
            return lone.group(1)
    hits = [h for h in _PAREN_LETTER.findall(text) if h in valid]
    return hits[-1] if hits else None


def gpqa_reward(inp: RewardInput) -> float:
    valid = _valid_letters(inp.metadata)
    return 1.0 if chosen_letter(inp.response, valid) == correct_letter(inp, valid) else 0.0
