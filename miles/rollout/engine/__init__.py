"""Rollout engines: the interface (`base`) and the built-in torch engine (`builtin`).

Importing this package is light (no torch); `from miles.rollout.engine.builtin import BuiltinEngine`
loads torch and transformers. The SGLang client implements the same `RolloutEngine` interface.
"""

from miles.rollout.engine.base import (
    GenerateRequest,
    GenerateResponse,
    RolloutEngine,
    SamplingParams,
    iter_weight_buckets,
    weights_checksum,
)

__all__ = [
    "GenerateRequest",
    "GenerateResponse",
    "RolloutEngine",
    "SamplingParams",
    "iter_weight_buckets",
    "weights_checksum",
]
