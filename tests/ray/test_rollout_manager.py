"""The rollout manager in-process, on the tiny model: over-sampling, filters, context cap, eval, resume."""

from __future__ import annotations

import json

import pytest

from miles.config.resolve import build_config, resolve
from miles.prepare.tiny_model import create_tiny_qwen3
from miles.ray.rollout_manager import RolloutManager
from miles.rollout.filters import FilterResult

def keep_only_group_zero(args, group):
    # Loaded by path (a second copy of this module), so it checks its argument instead of recording it.
    if type(args).__name__ != "RewardConfig":
        raise AssertionError(f"the filter got {type(args).__name__}, not the RewardConfig its docs promise")
    return FilterResult(keep=group[0].group_index % 2 == 0, reason="odd")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("rm")
    model = create_tiny_qwen3(root / "model", seed=0)
    rows = [{"input": f"{a}+{b}=", "label": str(a + b)} for a in range(4) for b in range(4)]
    (root / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:5]))
    return root, model


def make(setup, **values):
    root, model = setup
    base = {
        "hf_checkpoint": str(model), "prompt_data": str(root / "train.jsonl"), "label_key": "label", "rm_type": "exact_match",
        "rollout_batch_size": 2, "n_samples_per_prompt": 2, "num_rollout": 3, "actor_num_gpus_per_node": 1,
        "rollout_max_response_len": 3, "rollout_skip_special_tokens": True, "device": "cpu",
        "eval_prompt_data": ["arith", str(root / "eval.jsonl")], "eval_temperature": 0.0,
    }
    return RolloutManager(resolve(build_config({**base, **values}, environ={})))


def test_over_sampled_groups_come_back_first(setup):
    m = make(setup, over_sampling_batch_size=3)
    out = m.generate(0)
    assert len(out["train_data"]["tokens"]) == 4  # 2 groups × 2 samples kept
    assert len(m.data_source) == 1  # the third group was drawn, not needed, and given back
    returned = m.data_source._buffer[0][0]
    assert returned.response_length == 0 and returned.reward is None
    nxt = m.data_source.get_samples(1, 2)
    assert nxt[0][0].group_index == returned.group_index


def test_dynamic_filter_gets_the_reward_config_and_drops(setup):
    m = make(setup, dynamic_sampling_filter_path="tests.ray.test_rollout_manager.keep_only_group_zero", over_sampling_batch_size=4)
    out = m.generate(0)
    # groups 0..3 drawn: 0 kept, 1 dropped, 2 kept (batch full), 3 unused and given back
    assert out["metrics"]["rollout/dynamic_filter/drop_odd"] == 1.0
    assert len(m.data_source) == 1
    assert all(i // 2 % 2 == 0 for i in out["train_data"]["sample_indices"])


def test_context_length_caps_new_tokens(setup):
    m = make(setup, rollout_max_context_len=5, rollout_max_response_len=10)
    out = m.generate(0)
    for tokens, n in zip(out["train_data"]["tokens"], out["train_data"]["response_lengths"]):
        assert len(tokens) <= 5 and n <= 1  # prompts are 4 tokens


def test_eval_metrics_match_a_hand_count(setup):
    m = make(setup)
    metrics = m.eval(0)
    rows = [json.loads(x) for x in (setup[0] / "eval.jsonl").read_text().splitlines()]
    # Score the same greedy responses by hand.
    from miles.rollout.engine.base import GenerateRequest, SamplingParams

    reqs = [GenerateRequest(input_ids=m.tokenizer.encode(r["input"], add_special_tokens=False), sampling_params=SamplingParams(temperature=0, max_new_tokens=3)) for r in rows]
    texts = [x.text for x in m.engine.generate(reqs)]
    expected = sum(t.strip() == r["label"] for t, r in zip(texts, rows)) / len(rows)
    assert metrics["eval/arith/accuracy"] == expected


def test_data_position_round_trips(setup):
    a = make(setup, rollout_shuffle=True)
    a.generate(0)
    state = a.state_dict()
    b = make(setup, rollout_shuffle=True)
    b.load_state_dict(json.loads(json.dumps(state)))
    assert a.generate(1)["train_data"]["tokens"] == b.generate(1)["train_data"]["tokens"]


def test_eval_reports_accuracy_only_for_right_or_wrong_rewards(setup):
    """exact_match is right/wrong: accuracy = reward > 0. f1 is fractional: "reward > 0" would count a
    partly right answer as correct, so only the mean reward is reported."""
    binary = make(setup).eval(0)
    assert "eval/arith/accuracy" in binary and "eval/arith/reward" in binary
    fractional = make(setup, rm_type="f1").eval(0)
    assert "eval/arith/reward" in fractional and "eval/arith/accuracy" not in fractional
    assert 0.0 <= fractional["eval/arith/reward"] <= 1.0
