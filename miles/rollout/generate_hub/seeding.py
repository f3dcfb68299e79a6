"""Per-request sampling seeds: reproducible sampling without saving any engine RNG state.

Every request carries its own seed derived from (--rollout-seed, rollout id, sample index, purpose),
so a resumed run regenerates exactly what an uninterrupted run would have, whatever the batch.
"""

from __future__ import annotations

import hashlib


def request_seed(base: int, rollout_id: int, index: int, *, purpose: str = "train") -> int:
    """A 32-bit seed for sample `index` of rollout `rollout_id` (`purpose`: "train<draw>", "eval:<name>")."""
    digest = hashlib.sha256(f"{purpose}:{base}:{rollout_id}:{index}".encode()).digest()
    return int.from_bytes(digest[:4], "little")
