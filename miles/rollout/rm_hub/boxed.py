"""Find the last `\\boxed{...}` of a model response (the `boxed_` reward prefix and the math graders).

This only matches braces to find where the last box ends; it does not interpret LaTeX. Interpreting
the answer (fractions, sets, intervals, ...) is math-verify's job in `math_rm.py`.
"""

from __future__ import annotations

_BOX_OPENERS = ("\\boxed{", "\\fbox{")


def last_boxed_content(text: str) -> str | None:
    """The content of the last `\\boxed{...}` (or `\\fbox{...}`) in `text`, or None when there is none.

    Nested braces are balanced, so `\\boxed{\\frac{1}{2}}` gives `\\frac{1}{2}`. A box left unclosed
    (a truncated response) counts as no box: its content is not an answer the model committed to.
    """
    start = max(text.rfind(opener) for opener in _BOX_OPENERS)
    if start < 0:
        return None
    open_at = text.index("{", start)
    depth = 0
    for i in range(open_at, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[open_at + 1 : i]
    return None
