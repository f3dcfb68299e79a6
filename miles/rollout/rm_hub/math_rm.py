"""`math` and `deepscaler` rewards: is the model's final answer mathematically equal to the label?

Answer extraction and equivalence are math-verify's (a maintained LaTeX/sympy grader): `\\frac{1}{2}`
equals `0.5`, `\\{2,3\\}` equals `2,3`, `(x+1)^2` equals `x^2+2x+1`. We only decide *which text* is
the answer:

- `math`: the content of the response's last closed `\\boxed{}` (upstream's rule). A response with
  no closed box scores 0.0, as upstream's grader does: a truncated response ("so x = 12. Then we
  check whether 12 satisfies") or an answer stated only in passing has not committed to an answer,
  and scoring it 0 is what teaches a model to finish and box its answer. With
  `--math-free-text-fallback` such a response is graded on math-verify's own extraction from the
  free text (its last number or LaTeX expression) instead. Score 1.0 or 0.0.
- `deepscaler` (upstream semantics): only the text after the last `</think>` (or after `###Response`)
  counts, it must hold a `\\boxed{}` answer, else 0.0; then graded like `math`.

math-verify guards each parse and comparison with a SIGALRM timeout, which Python only allows on the
main thread; elsewhere (a Ray actor's thread) we run without it rather than crash.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from miles.rollout.rm_hub.boxed import last_boxed_content
from miles.rollout.rm_hub.types import RewardInput

_TIMEOUT_S = 5
# math-verify logs a warning on every call made without a timeout; once per process is enough.
logging.getLogger("math_verify").setLevel(logging.ERROR)


def _timeout() -> int | None:
    return _TIMEOUT_S if threading.current_thread() is threading.main_thread() else None


def _parse_bare_answer(answer: str) -> list[Any]:
    # Wrapping in \boxed{} tells math-verify "all of this is the answer": without it, "2,3" parses as
    # 2.3 and "\{1,2\}" not at all.
    from math_verify import parse

    if not answer.strip():
        return []
    return parse("\\boxed{" + answer + "}", parsing_timeout=_timeout())


def _parse_free_text(text: str) -> list[Any]:
    from math_verify import parse

    return parse(text, parsing_timeout=_timeout())


def answers_equal(pred: list[Any], gold: list[Any]) -> bool:
    """math-verify's equivalence of two parsed answers; an unparsable side is never equal."""
    from math_verify import verify

    if not pred or not gold:
        return False
    return bool(verify(gold, pred, timeout_seconds=_timeout()))


def _gold(label: str) -> list[Any]:
    boxed = last_boxed_content(label)
    return _parse_bare_answer(boxed if boxed is not None else label)


def math_reward(inp: RewardInput) -> float:
    gold = _gold(inp.label_text())
    if inp.answer_only:
        pred = _parse_bare_answer(inp.response)
    else:
        boxed = last_boxed_content(inp.response)
        if boxed is not None:
            pred = _parse_bare_answer(boxed)
        elif inp.free_text_fallback:
            pred = _parse_free_text(inp.response)
        else:
            return 0.0  # no committed answer (see the module docstring)
    return 1.0 if answers_equal(pred, gold) else 0.0


def deepscaler_reward(inp: RewardInput) -> float:
    label = inp.label_text()
    response = inp.response
    if "</think>" in response:
        solution = response.rsplit("</think>", 1)[1]
    elif "###Response" in response:
        solution = response.split("###Response", 2)[1]
    else:
        return 0.0
    answer = last_boxed_content(solution)
    if answer is None or not label.strip():
        return 0.0
    return 1.0 if answers_equal(_parse_bare_answer(answer), _gold(label)) else 0.0
