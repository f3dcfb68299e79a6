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


def test_dynamic_sampling_aborts_in_flight_groups_and_they_come_back_next_step(setup):
    # One group decodes at a time (2 batch slots, 2 samples per group), 8 groups are submitted for 2
    # needed and responses are long: when the 2nd group is kept, later groups are running or queued.
    m = make(setup, over_sampling_batch_size=8, rollout_max_batch_size=2, rollout_max_response_len=40)
    m.engine.eos_token_ids = frozenset()  # every response runs to its length limit
    finishes: list[str] = []
    aborts: list[str] = []
    submit, abort = m.engine.submit, m.engine.abort_request

    def spy_submit(request):
        future = submit(request)
        future.add_done_callback(lambda f: finishes.append(f.result().finish_type))
        return future

    m.engine.submit = spy_submit
    m.engine.abort_request = lambda rid="", abort_all=False: (aborts.append(rid), abort(rid, abort_all))
    out = m.generate(0)
    assert len(out["train_data"]["tokens"]) == 4
    assert out["train_data"]["sample_indices"] == [0, 1, 2, 3]  # the first two groups drawn, in draw order
    assert aborts == ["train-000000-"]
    assert out["metrics"]["rollout/aborted_groups"] == 6.0
    # Aborted mid-generation, not generated to the end and thrown away: 6 groups x 2 samples came
    # back "abort" (running ones with a partial response, queued ones with none).
    assert finishes.count("abort") == 12 and finishes.count("length") == 4
    assert len(m.data_source) == 6
    returned = [g[0].group_index for g in m.data_source._buffer]
    assert returned == [2, 3, 4, 5, 6, 7] and all(s.response_length == 0 and s.reward is None for g in m.data_source._buffer for s in g)
    # Next step: the aborted groups are the first ones drawn (and kept).
    nxt = m.generate(1)
    assert nxt["train_data"]["sample_indices"] == [4, 5, 6, 7]


def test_every_request_carries_exactly_its_prompt_ids_and_nothing_is_re_tokenized(setup):
    """Prompt ids come from the dataset (tokenized once) and survive an abort without the partial response."""
    m = make(setup, over_sampling_batch_size=8, rollout_max_batch_size=2, rollout_max_response_len=40)
    m.engine.eos_token_ids = frozenset()  # long responses: the aborted groups come back with partial ones
    prompt_ids = [m.tokenizer.encode(s.prompt, add_special_tokens=False) for s in m.dataset]
    sent, encodes = [], []
    submit, encode = m.engine.submit, m.tokenizer.encode
    m.engine.submit = lambda q: (sent.append(list(q.input_ids)), submit(q))[1]
    m.tokenizer.encode = lambda *a, **k: (encodes.append(a), encode(*a, **k))[1]
    first = m.generate(0)
    assert first["metrics"]["rollout/aborted_groups"] > 0
    second = m.generate(1)  # starts with the aborted groups
    assert len(sent) == 8 * 2 + 8 * 2 and all(ids in prompt_ids for ids in sent)
    assert encodes == []  # no prompt was tokenized again
    for out in (first, second):
        for tokens, n in zip(out["train_data"]["tokens"], out["train_data"]["response_lengths"]):
            assert tokens[: len(tokens) - n] in prompt_ids


def test_a_draw_is_submitted_together_and_when_all_keeps_order_and_errors():
    import asyncio
    from concurrent.futures import Future

    from miles.ray.rollout_manager import when_all

    async def run(futures, finish):
        waiter = when_all(futures)
        await asyncio.sleep(0)
        assert not waiter.done()
        for f, value in finish:
            (f.set_exception if isinstance(value, Exception) else f.set_result)(value)
            await asyncio.sleep(0)
        return await waiter

    fs = [Future() for _ in range(3)]
    assert asyncio.run(run(fs, [(fs[2], "c"), (fs[0], "a"), (fs[1], "b")])) == ["a", "b", "c"]
    fs = [Future() for _ in range(2)]
    with pytest.raises(ValueError, match="bad"):
        asyncio.run(run(fs, [(fs[1], ValueError("bad")), (fs[0], "a")]))
    assert asyncio.run(when_all_empty()) == []

    async def first_error_without_waiting_for_the_rest():
        fs = [Future() for _ in range(3)]
        waiter = when_all(fs)
        fs[1].set_exception(RuntimeError("engine died"))  # the other two never finish
        with pytest.raises(RuntimeError, match="engine died"):
            await asyncio.wait_for(waiter, 5)
        fs2 = [Future(), Future()]
        waiter2 = when_all(fs2)
        fs2[0].cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(waiter2, 5)

    asyncio.run(first_error_without_waiting_for_the_rest())


async def when_all_empty():
    from miles.ray.rollout_manager import when_all

    return await when_all([])


def test_one_draw_reaches_the_engine_inside_submitting_together(setup):
    m = make(setup, over_sampling_batch_size=3)
    inside = [False]
    calls: list[bool] = []
    lock = m.engine.submitting_together()

    class Together:
        def __enter__(self):
            lock.__enter__()
            inside[0] = True

        def __exit__(self, *exc):
            inside[0] = False
            return lock.__exit__(*exc)

    m.engine.submitting_together = Together
    submit = m.engine.submit
    m.engine.submit = lambda q: (calls.append(inside[0]), submit(q))[1]
    m.generate(0)
    assert len(calls) == 6 and all(calls)  # 3 groups x 2 samples, every one inside the one batch
