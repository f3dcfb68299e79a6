"""`f1` reward: token-level F1 between the response and the label (SQuAD/HotpotQA answer normalisation).

Both texts are lower-cased, stripped of punctuation and of the articles a/an/the, and split on
whitespace; F1 = 2PR/(P+R) over the multiset of common tokens. As in HotpotQA (and upstream), a
yes/no/noanswer answer on either side scores 0 unless both normalised texts are identical.
"""

from __future__ import annotations

import re
import string
from collections import Counter

from miles.rollout.rm_hub.types import RewardInput

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = str.maketrans("", "", string.punctuation)
_CLOSED_ANSWERS = frozenset({"yes", "no", "noanswer"})


def normalize_text(text: str) -> str:
    text = text.lower().translate(_PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", text).split())


def f1_precision_recall(prediction: str, reference: str) -> tuple[float, float, float]:
    pred, ref = normalize_text(prediction), normalize_text(reference)
    if (pred in _CLOSED_ANSWERS or ref in _CLOSED_ANSWERS) and pred != ref:
        return 0.0, 0.0, 0.0
    common = Counter(pred.split()) & Counter(ref.split())
    same = sum(common.values())
    if same == 0:
        return 0.0, 0.0, 0.0
    precision = same / len(pred.split())
    recall = same / len(ref.split())
    return 2 * precision * recall / (precision + recall), precision, recall


def f1_reward(inp: RewardInput) -> float:
    return f1_precision_recall(inp.response, inp.label_text())[0]
