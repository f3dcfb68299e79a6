"""Rollout metrics of multi-turn samples, from the counts their generate function left in `metadata`.

- `<prefix>/num_turns`: mean engine calls per sample;
- `<prefix>/tool_call_rate`: fraction of samples that called a tool at least once;
- `<prefix>/tool_error_rate`: fraction of tool calls answered with an error (0 when there were none).

Nothing is logged for samples without the counts (single-turn runs log exactly what they did before).
"""

from __future__ import annotations

from miles.sample import Sample


def turn_metrics(samples: list[Sample], prefix: str) -> dict[str, float]:
    counted = [s for s in samples if "num_turns" in s.metadata]
    if not counted:
        return {}
    calls = sum(int(s.metadata.get("tool_call_count", 0)) for s in counted)
    errors = sum(int(s.metadata.get("tool_error_count", 0)) for s in counted)
    return {
        f"{prefix}/num_turns": sum(int(s.metadata["num_turns"]) for s in counted) / len(counted),
        f"{prefix}/tool_call_rate": sum(int(s.metadata.get("tool_call_count", 0)) > 0 for s in counted) / len(counted),
        f"{prefix}/tool_error_rate": errors / calls if calls else 0.0,
    }
