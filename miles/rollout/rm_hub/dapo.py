"""`dapo` reward (DAPO-Math semantics): the last answer line of the response against the label.

What is read: the response's last 300 characters are searched for an answer marker, either
`Answer:` (case-insensitive; Minerva's `Final Answer:` included) or the Minerva sentence `The final
answer is`; the text after the last marker, to the end of its line, is the prediction (`[INVALID]`
when there is no marker).

How prediction and label are compared (`normalize_answer`, applied to both, then string equality),
following the normalisation the DAPO paper's grader describes:

1. the Minerva wrapper goes: a leading "The final answer is" and a trailing "I hope it is correct.";
2. when the text holds `$...$` math, only the first such span is kept ("The final answer is $42$.
   I hope it is correct." -> 42); then only what follows the last `=` (`x = 7` -> 7);
3. `\\text{}`, `\\textbf{}`, `\\mathrm{}`, `\\mbox{}`, `\\boxed{}`, `\\overline{}` wrappers are unwrapped;
4. units and counting words are dropped as whole words (degrees, cm, dollars, units, inches, ...;
   `_UNIT_WORDS`), as are degree marks, percent signs, `\\$`, LaTeX spacing and quotes, and a leading
   article ("a", "an");
5. `\\dfrac`/`\\tfrac` are written `\\frac`, `\\frac12` `\\frac{1}{2}` and `\\sqrt2` `\\sqrt{2}`; spaces and a trailing period go;
   thousands separators of an integer go (`1,000` -> 1000, while `1,2` stays a pair).

The label is then written as an integer when it is one, so "34.0" matches "34" (DAPO-Math labels are
integers); non-integer labels ("0.5", "\\frac{1}{2}") are compared as normalised text. The result is a
dict `{"score": 1.0 | -1.0, "acc": bool, "pred": str}`: train on it with `--reward-key score`.

This is string equality after normalisation, not symbolic equivalence; use `math` for that.
"""

from __future__ import annotations

import re
from typing import Any

from miles.rollout.rm_hub.types import RewardInput

_TAIL_CHARS = 300  # the longest MATH-500 answer has 159 characters; the answer line sits at the end
_ANSWER_LINE = re.compile(r"(?:answer\s*:|the\s+final\s+answer\s+is)\s*([^\n]+)", re.IGNORECASE)
_MINERVA_HEAD = re.compile(r"^\s*the\s+final\s+answer\s+is\s*:?\s*", re.IGNORECASE)
_MINERVA_TAIL = re.compile(r"\.?\s*I\s+hope\s+it\s+is\s+correct\.?\s*$", re.IGNORECASE)
_FIRST_MATH_SPAN = re.compile(r"(?<!\\)\$(.+?)(?<!\\)\$")
_WRAPPERS = re.compile(r"\\(?:text|textbf|mathrm|mbox|boxed|overline)\{([^{}]*)\}")
# Words a grader should not hold against an answer: units and what was counted. Whole words only, so
# "cm" goes from "12 cm" but not from "\\cmd".
_UNIT_WORDS = (
    "degrees", "degree", "cm", "mm", "km", "meters", "meter", "inches", "inch", "feet", "foot", "miles",
    "mph", "hours", "hour", "minutes", "minute", "seconds", "second", "dollars", "dollar", "cents", "cent",
    "pounds", "pound", "gm", "units", "unit", "square", "sq", "ways", "integers", "points", "digits",
    "students", "edges", "meals", "multiples", "people", "days", "years",
)
_UNITS = re.compile(r"(?<![\\A-Za-z])(?:" + "|".join(_UNIT_WORDS) + r")(?:\^\{?[23]\}?)?(?![A-Za-z])", re.IGNORECASE)
_ARTICLE = re.compile(r"^(?:an?|the)\s+", re.IGNORECASE)
_DROPPED = ("\\$", "^\\circ", "^{\\circ}", "\\circ", "\\%", "%", "\\!", "\\,", "\\;", "\\:", "\\ ", '"', "\\left", "\\right")
_FRAC_SHORTHAND = re.compile(r"\\([dt]?frac)(\d)(\d)")
_FRAC_HALF_SHORTHAND = re.compile(r"\\([dt]?frac)(\{[^{}]*\})(\d)")
_SQRT_SHORTHAND = re.compile(r"\\sqrt(\d)")


def normalize_answer(text: str) -> str:
    """The comparable form of an answer (see the module docstring, steps 1-5)."""
    text = _MINERVA_TAIL.sub("", _MINERVA_HEAD.sub("", str(text)))
    span = _FIRST_MATH_SPAN.search(text)
    if span:
        text = span.group(1)
    text = text.rsplit("=", 1)[-1]
    while True:  # innermost first until stable, so \boxed{\text{5}} becomes 5
        unwrapped = _WRAPPERS.sub(r"\1", text)
        if unwrapped == text:
            break
        text = unwrapped
    for piece in _DROPPED:
        text = text.replace(piece, "")
    text = _UNITS.sub("", text.replace("$", ""))
    text = _ARTICLE.sub("", text.strip())
    text = text.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    text = _FRAC_SHORTHAND.sub(r"\\\1{\2}{\3}", text)
    text = _FRAC_HALF_SHORTHAND.sub(r"\\\1\2{\3}", text)
    text = _SQRT_SHORTHAND.sub(r"\\sqrt{\1}", text)
    text = text.replace(" ", "").rstrip(".")
    if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", text):
        text = text.replace(",", "")
    return text


def _label_as_integer(label: str) -> str:
    try:
        value = float(label)
    except (ValueError, OverflowError):
        return label
    return str(int(value)) if value.is_integer() else label


def dapo_reward(inp: RewardInput) -> dict[str, Any]:
    gold = _label_as_integer(normalize_answer(inp.label_text()))
    matches = _ANSWER_LINE.findall(inp.response[-_TAIL_CHARS:])
    pred = _label_as_integer(normalize_answer(matches[-1])) if matches else "[INVALID]"
    correct = bool(pred) and pred == gold  # an answer that normalises to nothing matches nothing
    return {"score": 1.0 if correct else -1.0, "acc": correct, "pred": pred}
