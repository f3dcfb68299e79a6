"""The small reward types: `exact_match`, `deterministic_random`, `random`.

- `exact_match`: 1.0 when the response equals the label after stripping surrounding whitespace on
  both sides, else 0.0 (the tiny arithmetic recipe trains on it; "12" vs "12\\n" matches, "012" does not).
- `deterministic_random`: a reward that looks random but is a pure function of the sample, for tests
  and reproducible runs: the first byte of sha256(",".join(tokens) + "|" + response) (UTF-8) mod 2,
  as 0.0 or 1.0. Same sample, same reward, on any machine and run.
- `random` (upstream): 0.0 or 1.0 from Python's global `random`; not reproducible by design.
"""

from __future__ import annotations

import hashlib
import random

from miles.rollout.rm_hub.types import RewardInput


def exact_match_reward(inp: RewardInput) -> float:
    return 1.0 if inp.response.strip() == inp.label_text().strip() else 0.0


def deterministic_random_reward(inp: RewardInput) -> float:
    payload = ",".join(str(t) for t in inp.sample.tokens) + "|" + inp.response
    return float(hashlib.sha256(payload.encode("utf-8")).digest()[0] % 2)


def random_reward(inp: RewardInput) -> float:
    return float(random.randint(0, 1))
