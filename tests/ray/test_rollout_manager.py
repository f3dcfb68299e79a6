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


def test_one_draw_reaches_the_engine_inside_submitting_together(setup):
    """The whole draw is one batch: every request inside one `submitting_together()` (the engine
    client's order, errors and wake-ups: tests/rollout/test_generate_hub.py)."""
    m = make(setup, over_sampling_batch_size=3)
    inside = [False]
    calls: list[bool] = []
    batches = [0]
    lock = m.engine.submitting_together()

    class Together:
        def __enter__(self):
            lock.__enter__()
            inside[0] = True
            batches[0] += 1

        def __exit__(self, *exc):
            inside[0] = False
            return lock.__exit__(*exc)

    m.engine.submitting_together = Together
    submit = m.engine.submit
    m.engine.submit = lambda q: (calls.append(inside[0]), submit(q))[1]
    m.generate(0)
    assert len(calls) == 6 and all(calls)  # 3 groups x 2 samples, every one inside the one batch
    assert batches[0] == 1


# ------------------------------------------------------------------ the generate seam (miles/rollout/generate_hub)

SEAM_HOOKS = '''
import dataclasses

from miles.rollout.generate_hub import GenerateOutput, RolloutFnOutput
from miles.rollout.generate_hub.single_turn import generate as single_turn

CALLS = []
ROLLOUTS = []


async def first_token_only(input):
    """Generates as single-turn does, then keeps a copy cut to its first response token."""
    s = await single_turn(input)
    keep = s.prompt_length + 1
    out = dataclasses.replace(s, tokens=s.tokens[:keep], response_length=1, rollout_log_probs=s.rollout_log_probs[:1],
                              metadata={**s.metadata, "made_by": "first_token_only"})
    CALLS.append({"rollout_id": input.rollout_id, "index": s.index, "evaluation": input.evaluation,
                  "seed": input.sampling_params.seed, "rid": input.rid, "tokens": list(out.tokens)})
    return GenerateOutput(out)


async def rewarded(input):
    s = await single_turn(input)
    s.reward = 0.25 if s.index % 2 else None  # the odd ones bring their own reward
    return s


async def one_group_of_doubles(input):
    """Draws half the prompts and makes two samples of each (a list output)."""
    d = input.cfg.data
    groups = input.data_source.get_samples(d.rollout_batch_size // 2, d.n_samples_per_prompt)
    out = []
    for g in groups:
        made = []
        for s in g:
            made += await input.generate(s)
            made.append(dataclasses.replace(made[-1], reward=None))
        out.append(made)
    ROLLOUTS.append({"rollout_id": input.rollout_id, "indices": [s.index for g in out for s in g]})
    return RolloutFnOutput(out, metrics={"rollout/my_metric": 7.0})


async def too_few(input):
    return input.data_source.get_samples(1, 1)
'''


@pytest.fixture(scope="module")
def seam_hooks(setup):
    path = setup[0] / "seam_hooks.py"
    path.write_text(SEAM_HOOKS)
    return path


def hook_globals(path: str, *, rollout: bool = False) -> dict:
    from miles.rollout.generate_hub import load_generate_function, load_rollout_function

    return (load_rollout_function if rollout else load_generate_function)(path).__globals__  # the instance the manager runs


def test_a_custom_generate_function_makes_every_sample_and_its_samples_are_trained_on(setup, seam_hooks):
    path = f"{seam_hooks}:first_token_only"
    calls = hook_globals(path)["CALLS"]
    calls.clear()
    m = make(setup, custom_generate_function_path=path, over_sampling_batch_size=2)
    out = m.generate(0)["train_data"]
    assert sorted(c["index"] for c in calls) == [0, 1, 2, 3]  # every sample of the rollout, once
    assert all(not c["evaluation"] and c["rollout_id"] == 0 for c in calls)
    assert len({c["seed"] for c in calls}) == 4  # each its own seed
    assert sorted(c["rid"] for c in calls) == ["train-000000-000001-0000", "train-000000-000001-0001", "train-000000-000002-0000", "train-000000-000002-0001"]
    by_index = {c["index"]: c["tokens"] for c in calls}
    assert out["response_lengths"] == [1, 1, 1, 1]  # what it returned, not what the engine generated
    assert out["tokens"] == [by_index[i] for i in out["sample_indices"]]
    assert all(len(lp) == 1 for lp in out["rollout_log_probs"])


def test_the_custom_generate_function_makes_the_eval_samples_too(setup, seam_hooks):
    path = f"{seam_hooks}:first_token_only"
    calls = hook_globals(path)["CALLS"]
    calls.clear()
    metrics = make(setup, custom_generate_function_path=path).eval(3)
    assert sorted(c["index"] for c in calls) == [0, 1, 2, 3, 4] and all(c["evaluation"] and c["rid"] is None for c in calls)
    assert metrics["eval/arith/response_len_mean"] == 1.0


def test_a_reward_the_generate_function_set_is_kept_and_the_others_are_scored(setup, seam_hooks):
    m = make(setup, custom_generate_function_path=f"{seam_hooks}:rewarded")
    out = m.generate(0)["train_data"]
    raw = dict(zip(out["sample_indices"], out["raw_reward"]))
    assert all(raw[i] == 0.25 for i in raw if i % 2) and all(raw[i] in (0.0, 1.0) for i in raw if not i % 2)


def test_a_rollout_function_replaces_the_rollout_and_its_samples_are_trained_on(setup, seam_hooks):
    path = f"{seam_hooks}:one_group_of_doubles"
    rollouts = hook_globals(path, rollout=True)["ROLLOUTS"]
    rollouts.clear()
    m = make(setup, rollout_function_path=path, rollout_batch_size=2, n_samples_per_prompt=2)
    out = m.generate(0)
    assert rollouts == [{"rollout_id": 0, "indices": [0, 0, 1, 1]}]  # one prompt, 2 samples, each doubled
    assert out["train_data"]["sample_indices"] == [0, 0, 1, 1]
    assert out["metrics"]["rollout/my_metric"] == 7.0
    assert "rollout/aborted_groups" not in out["metrics"]  # the built-in rollout did not run
    assert len(out["train_data"]["raw_reward"]) == 4 and all(r in (0.0, 1.0) for r in out["train_data"]["raw_reward"])
    assert 0.0 <= out["metrics"]["rollout/zero_std_fraction"] <= 1.0  # one group of 4: its own std


def test_a_rollout_function_with_the_wrong_number_of_samples_is_a_user_error(setup, seam_hooks):
    from miles.errors import UserError

    m = make(setup, rollout_function_path=f"{seam_hooks}:too_few")
    with pytest.raises(UserError, match=r"--rollout-function-path made 1 samples for rollout 0; .* = 4") as e:
        m.generate(0)
    assert e.value.option == "--rollout-function-path"


def test_a_rollout_that_fails_leaves_no_task_running_into_the_next(setup):
    """The manager keeps one event loop for its rollouts; as `asyncio.run` did, what a failed rollout
    left running is cancelled before the call returns, not resumed by the next rollout's loop run."""
    import asyncio

    m = make(setup)
    ran_on: list[str] = []

    async def straggler():
        await asyncio.sleep(0.05)
        ran_on.append("next rollout")

    async def failing_rollout():
        asyncio.get_running_loop().create_task(straggler())
        await asyncio.sleep(0)
        raise RuntimeError("the rollout failed")

    with pytest.raises(RuntimeError, match="the rollout failed"):
        m._run(failing_rollout())
    m.generate(0)  # a real rollout on the same loop, long enough for the straggler to have finished
    m._run(asyncio.sleep(0.1))
    assert ran_on == []
    # The same loop serves both (a fresh loop per rollout cost ~1-4 ms of it).
    loop = m._loop
    m.generate(1)
    assert m._loop is loop and not loop.is_closed()
    m.shutdown()
    assert loop.is_closed()


# -- rewards: in the group's task where nothing waits, through compute_group_rewards otherwise ------------
def _scored(monkeypatch, rm_type: str, metadata=None, **reward):
    """The rewards `_score_group` gives a group of 4, and how many groups went to `compute_group_rewards`."""
    import asyncio
    import types

    import miles.ray.rollout_manager as rm
    from miles.config.reward import RewardConfig
    from miles.sample import Sample

    calls = []
    concurrent = rm.compute_group_rewards

    async def recording(cfg, samples):
        calls.append(len(samples))
        return await concurrent(cfg, samples)

    monkeypatch.setattr(rm, "compute_group_rewards", recording)
    group = [Sample(response=r, label="12", metadata=dict(metadata or {}), index=i) for i, r in enumerate(["12", "13", "12", "x"])]
    stub = types.SimpleNamespace(cfg=types.SimpleNamespace(reward=RewardConfig(rm_type=rm_type, **reward)))
    asyncio.run(RolloutManager._score_group(stub, group))
    return [s.reward for s in group], calls


def test_local_rewards_are_scored_in_the_groups_own_task_with_the_same_values(monkeypatch):
    rewards, calls = _scored(monkeypatch, "exact_match")
    assert rewards == [1.0, 0.0, 1.0, 0.0] and calls == []  # no task per sample


def test_the_random_reward_and_a_remote_rm_keep_the_concurrent_path(monkeypatch):
    import random

    random.seed(3)
    rewards, calls = _scored(monkeypatch, "random")
    random.seed(3)
    assert calls == [4] and rewards == [float(random.randint(0, 1)) for _ in range(4)]  # draws in sample order
    # One sample's metadata asks for a remote RM: the whole group goes the concurrent way.
    import miles.rollout.rm_hub as hub

    async def remote(cfg, inp):
        return 0.5

    monkeypatch.setattr(hub, "remote_reward", remote)
    rewards, calls = _scored(monkeypatch, "exact_match", metadata={"rm_type": "remote_rm"}, rm_url="http://x")
    assert calls == [4] and rewards == [0.5] * 4
