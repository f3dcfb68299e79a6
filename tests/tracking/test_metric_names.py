"""The metric-name table: the doc block is generated from it, and every name the code emits is in it."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import torch

from miles.tracking.metric_names import (
    BEGIN,
    END,
    PREFIXES,
    is_documented,
    metric_names,
    metric_names_markdown,
    replace_block,
)

ROOT = Path(__file__).resolve().parents[2]

REQUIRED = """rollout/raw_reward rollout/reward_std rollout/response_len_mean rollout/truncated_ratio
rollout/zero_std_fraction train/loss train/pg_loss train/pg_clipfrac train/ppo_kl train/grad_norm train/lr
train/entropy_loss train/kl_loss eval/<ds>/accuracy eval/<ds>/reward eval/<ds>/response_len_mean
perf/rollout_time perf/train_time perf/weight_sync_time perf/step_time perf/rollout_tokens_per_s
perf/train_tokens_per_s perf/eval_time""".split()


def test_doc_block_equals_the_generated_table() -> None:
    doc = (ROOT / "docs" / "monitoring.md").read_text(encoding="utf-8")
    block = doc[doc.index(BEGIN) + len(BEGIN) : doc.index(END)]
    assert block == metric_names_markdown(), "run: python -m miles.tracking.metric_names --write docs/monitoring.md"
    assert replace_block(doc) == doc


def test_table_is_complete_unique_and_prefixed() -> None:
    names = [n for n, _ in metric_names()]
    assert set(REQUIRED) <= set(names)
    assert len(names) == len(set(names))
    assert all(n.startswith(PREFIXES) for n in names)
    assert all(meaning.endswith(".") and len(meaning) > 10 for _, meaning in metric_names())
    lines = metric_names_markdown().splitlines()
    assert lines[:2] == ["| Metric | Meaning |", "|---|---|"] and len(lines) == len(names) + 2


def test_is_documented_expands_placeholders_by_one_segment() -> None:
    assert is_documented("eval/gsm8k/accuracy")
    assert is_documented("rollout/dynamic_filter/drop_zero_std_1.0")
    assert is_documented("train/mis_tis_weight_after_bound")
    assert not is_documented("eval/a/b/accuracy")  # a placeholder is one path segment
    assert not is_documented("eval/gsm8k/accuracyx")
    assert not is_documented("rollout/raw_reward_mean")


def _emitted_literals() -> set[str]:
    """Metric-name string literals in miles/ (f-string fields become `x`), outside this package."""
    found = set()
    pattern = re.compile(r"""f?["']((?:rollout|train|eval|perf)/[A-Za-z0-9_{}./-]+)["']""")
    for path in (ROOT / "miles").rglob("*.py"):
        if "tracking" in path.parts:
            continue
        for name in pattern.findall(path.read_text(encoding="utf-8")):
            found.add(re.sub(r"\{[^}]*\}", "x", name))
    return found


def test_names_in_the_source_are_documented() -> None:
    emitted = _emitted_literals()
    assert "rollout/raw_reward" in emitted and "eval/x/accuracy" in emitted  # the scan sees the loop's names
    # `train/{k}` prefixes the loss metrics: checked against the losses themselves below.
    # `eval/{name}` alone is the prefix handed to generate_hub.turn_metrics: its names are checked below.
    undocumented = sorted(n for n in emitted if n not in ("train/x", "eval/x") and not is_documented(n))
    assert not undocumented, f"add these to miles/tracking/metric_names.py: {undocumented}"


def test_multi_turn_metrics_are_documented_under_rollout_and_eval() -> None:
    from miles.rollout.generate_hub.turn_metrics import turn_metrics
    from miles.sample import Sample

    sample = Sample(metadata={"num_turns": 2, "tool_call_count": 1, "tool_error_count": 0})
    for prefix in ("rollout", "eval/gsm8k"):
        names = turn_metrics([sample], prefix)
        assert names and all(is_documented(n) for n in names), names


def test_every_loss_metric_is_documented_under_train_and_critic() -> None:
    from miles.algo.losses import policy_loss, value_loss
    from miles.config.algo import AlgoConfig

    cfg = AlgoConfig(use_kl_loss=True, kl_loss_coef=0.1, use_tis=True, entropy_coef=0.01)
    rule = next(f for f in dataclasses.fields(AlgoConfig) if f.name == "eps_clip_high").metadata["derived"].rule
    cfg.eps_clip_high = rule(type("Root", (), {"algo": cfg})())  # as resolve() fills it
    from miles.algo.segments import Segments

    lp, mask, seg = torch.tensor([-1.0, -1.2]), torch.tensor([1.0, 1.0]), Segments.from_lengths([2])
    _, m = policy_loss(
        cfg, log_probs=lp, old_log_probs=lp, advantages=torch.tensor([1.0, -1.0]), loss_mask=mask, segments=seg,
        ref_log_probs=torch.tensor([-1.1, -1.0]), rollout_log_probs=torch.tensor([-0.9, -1.3]),
        entropy=torch.tensor([0.5, 0.7]),
    )
    _, v = value_loss(cfg, values=lp, old_values=lp, returns=lp, loss_mask=mask, segments=seg)
    # The critic's step prefixes its loss metrics with critic/ (miles.train.step.train_critic).
    missing = sorted(n for n in [*(f"train/{k}" for k in m), *(f"critic/{k}" for k in v)] if not is_documented(n))
    assert not missing, f"add these to miles/tracking/metric_names.py: {missing}"
