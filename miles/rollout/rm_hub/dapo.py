"""`dapo` reward (upstream DAPO-Math semantics): the last "Answer: ..." line against an integer label.

The response's last 300 characters are searched for `Answer: <text>` (case-insensitive, to the end of
the line); the last match is the prediction, `[INVALID]` when there is none. Prediction and label are
normalised the same way (text after the last `=`, `$`, `\\text{}`/`\\boxed{}` wrappers, LaTeX spacing,
trailing period, degree/percent marks and thousands separators removed); the label is then written as
an integer when it is one (DAPO-Math labels are integers, so "34.0" becomes "34"). The result is a dict
`{"score": 1.0 | -1.0, "acc": bool, "pred": str}`: train on it with `--reward-key score`.

This is string equality after normalisation, not symbolic equivalence; use `math` for that.
"""

from __future__ import annotations

import re
from typing import Any

from miles.rollout.rm_hub.types import RewardInput

_TAIL_CHARS = 300  # the longest MATH-500 answer has 159 characters; the answer line sits at the end
_ANSWER_LINE = re.compile(r"answer\s*:\s*([^\n]+)", re.IGNORECASE)
_WRAPPERS = re.compile(r"\\(?:text|textbf|mathrm|mbox|boxed)\{([^{}]*)\}")
_DROPPED = ("$", "\\!", "\\,", "\\;", "\\ ", "^\\circ", "^{\\circ}", "\\%", "%", " ")


def normalize_answer(text: str) -> str:
    text = str(text).rsplit("=", 1)[-1]
    # Unwrap innermost-first until stable, so \boxed{\text{5}} becomes 5.
    while True:
        unwrapped = _WRAPPERS.sub(r"\1", text)
        if unwrapped == text:
            break
        text = unwrapped
    for piece in _DROPPED:
        text = text.replace(piece, "")
    text = text.strip().rstrip(".")
    if re.fullmatch(r"-?\d{1,3}(,\d{3})+", text):
        text = text.replace(",", "")
    return text


def _label_as_integer(label: str) -> str:
    try:
        return str(int(float(label)))
    except (ValueError, OverflowError):
        return label


def dapo_reward(inp: RewardInput) -> dict[str, Any]:
    gold = _label_as_integer(normalize_answer(inp.label_text()))
    matches = _ANSWER_LINE.findall(inp.response[-_TAIL_CHARS:])
    pred = normalize_answer(matches[-1]) if matches else "[INVALID]"
    correct = pred == gold
    return {"score": 1.0 if correct else -1.0, "acc": correct, "pred": pred}
