"""Rollout engines behind one interface (`base.RolloutEngine`).

- `builtin`: the built-in torch engine (continuous batching, KV cache), in-process;
- `server`: that engine as an HTTP server speaking SGLang's API subset;
- `http_client`: the interface over HTTP (a server, or /generate through a router);
- `router`: launching the real sglang-router; `fleet`: N engine servers behind it, with health
  checks and fault tolerance; `factory.make_engine`: which one a configuration asks for;
- `weight_transport`: both ends of the broadcast and disk weight paths.

Importing this package is light (no torch); `from miles.rollout.engine.builtin import BuiltinEngine`
loads torch and transformers.
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
