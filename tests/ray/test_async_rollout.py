"""Asynchronous rollout in the rollout manager, in-process on the tiny model: partial rollouts continue
their tokens and log-probs (and mask the old policy's), the --fully-async buffer never hands out a group
older than --max-weight-staleness, and its checkpoint state loses and repeats no prompt."""

from __future__ import annotations

import json
import time

import pytest

from miles.errors import StepFailed
from miles.ray.fully_async import group_lag
from miles.sample import SampleStatus
from tests.ray.test_rollout_manager import make, setup  # noqa: F401  (the module fixture)


def _long(m):
    m.engine.eos_token_ids = frozenset()  # every response runs to its length limit


def _bump(m, version: int) -> None:
    """A weight update with no new tensors: what the engines serve is now `version`."""
    m.begin_weight_update()
    m.end_weight_update(version)


def _aborted_partway(m, tokens: int):
    """The first prompt group generated for `tokens` tokens and given back as an abort leaves it: what the
    over-sampling abort gives back under --partial-rollout, without depending on when the abort lands."""
    import asyncio
    import dataclasses

    from miles.rollout.engine.base import SamplingParams

    [group] = m.data_source.get_samples(1, m.cfg.data.n_samples_per_prompt)
    params = dataclasses.replace(SamplingParams.from_rollout_config(m.cfg.rollout), max_new_tokens=tokens)
    asyncio.run(m._generate_group(group, rollout_id=0, purpose="train", params=params))
    for s in group:
        assert s.response_length == tokens
        s.status = SampleStatus.ABORTED
    m.data_source.add_samples([group])
    return {s.index: (list(s.tokens), list(s.rollout_log_probs), list(s.weight_versions)) for s in group}


def test_over_sampling_abort_gives_back_partial_responses(setup):  # noqa: F811
    m = make(setup, over_sampling_batch_size=8, rollout_max_batch_size=2, rollout_max_response_len=40, partial_rollout=True)
    _long(m)
    first = m.generate(0)
    assert first["metrics"]["rollout/aborted_groups"] == 6.0
    back = [s for g in m.data_source._buffer for s in g]
    assert len(back) == 12 and all(s.status == SampleStatus.ABORTED and s.reward is None for s in back)
    for s in back:  # whatever each had generated when the abort landed is kept, consistently
        assert len(s.rollout_log_probs or []) == s.response_length == len(s.weight_versions or [])
    assert first["metrics"]["rollout/partial_aborted_samples"] == sum(s.response_length > 0 for s in back)


def test_partial_rollout_continues_earlier_tokens_and_log_probs(setup):  # noqa: F811
    m = make(setup, rollout_max_response_len=40, partial_rollout=True)
    _long(m)
    before = _aborted_partway(m, 7)
    _bump(m, 1)
    sent = []
    submit = m.engine.submit
    m.engine.submit = lambda q: (sent.append(list(q.input_ids)), submit(q))[1]
    captured = {}
    generate_fn = m.generate_fn

    async def spy(input):
        out = await generate_fn(input)
        captured[input.sample.index] = input.sample
        return out

    m.generate_fn = spy
    out = m.generate(1)
    assert out["metrics"]["rollout/partial_continued_samples"] == 2.0
    for i, (tokens, logprobs, versions) in before.items():
        s = captured[i]
        assert tokens in sent  # the request continued from every earlier token, prompt and response
        assert s.tokens[: len(tokens)] == tokens and s.rollout_log_probs[:7] == logprobs
        assert s.response_length == 40 and len(s.rollout_log_probs) == 40  # the length limit counts both parts
        assert s.weight_versions == [0] * 7 + [1] * 33 and versions == [0] * 7
        assert s.loss_mask is None  # no mask without --mask-offpolicy-in-partial-rollout
    assert out["metrics"]["rollout/weight_staleness_max"] == 1.0  # rollout 1 trains tokens of version 0


def test_mask_offpolicy_zeroes_the_old_policy_tokens(setup):  # noqa: F811
    m = make(setup, rollout_max_response_len=40, partial_rollout=True, mask_offpolicy_in_partial_rollout=True)
    _long(m)
    old = _aborted_partway(m, 7)
    _bump(m, 1)
    td = m.generate(1)["train_data"]
    masks = dict(zip(td["sample_indices"], td["loss_masks"]))
    for idx, mask in masks.items():
        assert mask == ([0] * 7 + [1] * 33 if idx in old else [1] * 40)
    assert set(old) <= set(masks)
    # Through the policy loss: the old-policy tokens' log-probs get no gradient, every other token does.
    import torch

    from miles.algo.losses import policy_loss
    from miles.algo.segments import pack
    from miles.config.algo import AlgoConfig

    mask, seg = pack([torch.tensor(x, dtype=torch.float32) for x in td["loss_masks"]])
    lp = torch.linspace(-3.0, -0.5, mask.numel()).requires_grad_()
    cfg = AlgoConfig(eps_clip_high=0.2)
    loss, _ = policy_loss(cfg, log_probs=lp, old_log_probs=lp.detach() - 0.05, advantages=torch.ones_like(mask), loss_mask=mask, segments=seg)
    loss.backward()
    assert torch.equal(lp.grad == 0, mask == 0) and int((mask == 0).sum()) == 7 * len(old)


def _fill_buffer(m, timeout=120.0):
    """Wait (up to `timeout`) until the worker's buffer is full: groups of the current version wait there."""
    w = m._async_worker
    deadline = time.monotonic() + timeout
    while len(w._buffer) < w.capacity and time.monotonic() < deadline:
        time.sleep(0.1)


def _dumped(tmp_path, rollout_id: int) -> list[dict]:
    return [json.loads(x) for x in (tmp_path / f"{rollout_id}.jsonl").read_text().splitlines()]


def test_fully_async_never_hands_out_a_group_older_than_the_bound(setup, tmp_path):  # noqa: F811
    dump = str(tmp_path / "{rollout_id}.jsonl")
    m = make(setup, fully_async=True, use_tis=True, max_weight_staleness=0, rollout_max_response_len=4, save_debug_rollout_data=dump)
    out0 = m.generate(0)
    assert out0["metrics"]["rollout/weight_staleness_max"] == 0.0
    _fill_buffer(m)  # groups generated with version 0 wait in the buffer
    w = m._async_worker
    with w._cond:
        stale = {g[0].group_index for _, _, g in w._buffer}
        assert stale and all(v == 0 for _, _, g in w._buffer for s in g for v in s.weight_versions)
    _bump(m, 1)
    out1 = m.generate(1)
    # Rollout 1 trains on version 1: a version-0 token lags 1 update, above the bound of 0. Every buffered
    # group is refused (the counter may add groups that were in flight across the update).
    assert all(min(r["weight_versions"]) == 1 for r in _dumped(tmp_path, 1)), "a group older than the bound was trained"
    assert out1["metrics"]["rollout/weight_staleness_max"] == 0.0
    assert out1["metrics"]["rollout/stale_groups_regenerated"] >= len(stale)
    # Refused groups go back to the prompt source to be generated again: after two more updates (each
    # refusing what the buffer holds again), every refused group is trained once or still waiting to be
    # generated, never both, and no trained group is older than its step's version.
    trained = [r["group_index"] for k in range(2) for r in _dumped(tmp_path, k)[::2]]
    for k in (2, 3):
        _bump(m, k)
        m.generate(k)
        rows = _dumped(tmp_path, k)
        assert all(min(r["weight_versions"]) == k for r in rows)
        trained += [r["group_index"] for r in rows[::2]]
    waiting = [g[0]["group_index"] for g in m.state_dict()["data_source"]["buffer"]]
    assert len(trained) == len(set(trained)) and not set(trained) & set(waiting), (trained, waiting)
    assert stale <= set(trained) | set(waiting), (stale, trained, waiting)
    m.shutdown()


def test_fully_async_without_a_bound_trains_older_groups(setup):  # noqa: F811
    m = make(setup, fully_async=True, use_tis=True, rollout_max_response_len=4)
    m.generate(0)
    _fill_buffer(m)
    _bump(m, 1)
    out1 = m.generate(1)
    assert out1["metrics"]["rollout/weight_staleness_max"] == 1.0  # what the bound of the test above refuses
    assert "rollout/stale_groups_regenerated" not in out1["metrics"]
    m.shutdown()


def test_fully_async_checkpoint_state_loses_and_repeats_no_prompt(setup):  # noqa: F811
    m = make(setup, fully_async=True, use_tis=True, rollout_max_response_len=4)
    trained = []
    for r in range(3):
        trained += [i for i in m.generate(r)["train_data"]["sample_indices"]]
        if r == 1:
            _bump(m, 2)
    state = m.state_dict()
    m.shutdown()
    # A resumed manager draws what the state holds first, then fresh prompts: every group drawn by the
    # interrupted one is either trained or drawn again, never both.
    fresh = make(setup, fully_async=True, use_tis=True, rollout_max_response_len=4)
    fresh.load_state_dict(state)
    handed_out = state["data_source"]["num_groups_handed_out"]
    again = [s.index for g in fresh.data_source.get_samples(handed_out + 2, 2) for s in g]
    trained_groups = {i // 2 for i in trained}
    again_groups = [i // 2 for i in again]
    assert not trained_groups & set(again_groups)
    assert trained_groups | set(again_groups) >= set(range(handed_out))
    assert all(s.status == SampleStatus.PENDING and s.response_length == 0 for g in fresh.data_source._buffer for s in g)


def test_group_lag_is_the_oldest_token():
    from miles.sample import Sample

    g = [Sample(weight_versions=[3, 3, 2]), Sample(weight_versions=[4])]
    assert group_lag(g, 5) == 3 and group_lag([Sample()], 5) is None
    # A generate function that records only the finishing request's version (multi-turn) is bounded by it.
    assert group_lag([Sample(weight_version=1), Sample(weight_versions=[], weight_version=4)], 5) == 4


def test_fully_async_bound_refuses_groups_without_a_weight_version(setup):  # noqa: F811
    m = make(setup, fully_async=True, use_tis=True, max_weight_staleness=1, rollout_max_response_len=4,
             custom_generate_function_path="tests.ray.test_async_rollout.unversioned_generate")  # fmt: skip
    with pytest.raises(StepFailed, match="no weight version .* cannot be bounded"):
        m.generate(0)
    m.shutdown()


async def unversioned_generate(input):
    """The built-in generate function, with no weight version recorded (a custom one that forgets)."""
    from miles.rollout.generate_hub.single_turn import generate

    s = await generate(input)
    s.weight_version = s.weight_versions = None
    return s
