"""Agentic generation through the session server's HTTP endpoint, with an agent loaded by path.

The agent is the documented example (docs/examples/calculator_agent.py): it speaks plain OpenAI chat
over HTTP; the engine is scripted, and the sample must be the engine's ids and log-probs exactly.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from miles.config.algo import AlgoConfig
from miles.config.rollout import RolloutConfig
from miles.rollout.engine.base import SamplingParams
from miles.rollout.generate_hub import GenerateInput, agentic_tool_call
from miles.rollout.generate_hub.session_server import SessionServer
from miles.rollout.train_data import samples_to_train_data
from miles.sample import Sample, SampleStatus

from tests.rollout.test_multi_turn import ScriptedEngine, answer, call

AGENT = str(Path(__file__).resolve().parents[2] / "docs" / "examples" / "calculator_agent.py")


@pytest.fixture(scope="module")
def tok():
    from miles.prepare.tiny_model import build_chat_tokenizer

    return build_chat_tokenizer()


def make_input(tok, engine, agent=f"{AGENT}:run_agent", rid="r-"):
    sample = Sample(prompt="What is 123*45?", index=0, group_index=0, metadata={"answer": "5535"})
    cfg = SimpleNamespace(rollout=dataclasses.replace(RolloutConfig(), custom_agent_function_path=agent, use_session_server=True))
    return GenerateInput(sample=sample, sampling_params=SamplingParams(max_new_tokens=100, seed=3), engine=engine,  # type: ignore[arg-type]
                         cfg=cfg, tokenizer=tok, rollout_id=0, rid=rid)  # type: ignore[arg-type]


def test_agent_by_path_drives_a_rollout_through_the_session_endpoint(tok):
    turns = [call(tok, "calculator", {"expression": "123*45"}, spell=True), answer(tok, "It is 5535.")]
    engine = ScriptedEngine(tok, turns)
    s = asyncio.run(agentic_tool_call.generate(make_input(tok, engine)))
    assert s.status == SampleStatus.COMPLETED and s.metadata["num_turns"] == 2 and s.metadata["tool_call_count"] == 1
    # Token in, token out: each turn's prompt is the session's ids so far, the trained ids are the engine's.
    for req in engine.requests:
        assert s.tokens[: len(req.input_ids)] == req.input_ids
    assert engine.requests[0].input_ids == tok.apply_chat_template(
        [{"role": "user", "content": "What is 123*45?"}], add_generation_prompt=True, tokenize=True)["input_ids"]
    trained = [t for t, m in zip(s.response_tokens, s.loss_mask) if m]
    assert trained == turns[0] + turns[1]
    assert [x for x, m in zip(s.rollout_log_probs, s.loss_mask) if m] == engine.logprobs[0] + engine.logprobs[1]
    masked = tok.decode([t for t, m in zip(s.response_tokens, s.loss_mask) if not m], skip_special_tokens=False)
    assert "<tool_response>5535</tool_response>" in masked
    # The agent's reward is the sample's and the one trained on.
    assert s.reward == 1.0
    data = samples_to_train_data([s], algo=AlgoConfig(), n_samples_per_prompt=1, reward_key=None)
    assert data["raw_reward"] == [1.0]
    wrong = ScriptedEngine(tok, [answer(tok, "It is 12.")])
    assert asyncio.run(agentic_tool_call.generate(make_input(tok, wrong))).reward == 0.0


def test_session_rejects_histories_that_do_not_extend_it(tok):
    engine = ScriptedEngine(tok, [answer(tok, "hi"), answer(tok, "again")])
    server = SessionServer(engine, tok)
    try:
        import requests

        sid = server.open(rid=None, params=SamplingParams(max_new_tokens=20), tools=None, max_context=None)
        url = f"{server.url}/sessions/{sid}/v1/chat/completions"
        first = [{"role": "user", "content": "hello"}]
        r = requests.post(url, json={"messages": first}, timeout=30)
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "hi"
        rewritten = [{"role": "user", "content": "HELLO"}, {"role": "assistant", "content": "hi"}, {"role": "user", "content": "more"}]
        assert requests.post(url, json={"messages": rewritten}, timeout=30).status_code == 400
        forged = first + [{"role": "assistant", "content": "hi"}, {"role": "assistant", "content": "I said"}]
        assert requests.post(url, json={"messages": forged}, timeout=30).status_code == 400
        assert requests.post(f"{server.url}/sessions/nope/v1/chat/completions", json={"messages": first}, timeout=30).status_code == 404
        ok = first + [{"role": "assistant", "content": "hi"}, {"role": "user", "content": "more"}]
        r = requests.post(url, json={"messages": ok}, timeout=30)
        assert r.status_code == 200
        rec = server.close(sid)
        assert rec.turns == 2 and len(engine.requests) == 2
        assert engine.requests[1].input_ids == rec.prompt_ids + rec.response_ids[: len(engine.requests[1].input_ids) - len(rec.prompt_ids)]
    finally:
        server.stop()


def test_an_aborted_session_answers_503_and_its_sample_is_aborted(tok):
    engine = ScriptedEngine(tok, [call(tok, "calculator", {"expression": "1+1"}), answer(tok, "2")], ["abort", "stop"])
    s = asyncio.run(agentic_tool_call.generate(make_input(tok, engine)))
    assert s.status == SampleStatus.ABORTED and len(engine.requests) == 1


def test_a_raising_agent_keeps_what_the_session_made(tok, tmp_path):
    (tmp_path / "agent.py").write_text(
        "import aiohttp\n"
        "async def run_agent(base_url, prompt, request_kwargs, metadata, **kw):\n"
        "    async with aiohttp.ClientSession() as h:\n"
        "        async with h.post(base_url + '/v1/chat/completions', json={'messages': prompt}) as r:\n"
        "            await r.json()\n"
        "    raise RuntimeError('agent bug')\n"
    )
    engine = ScriptedEngine(tok, [answer(tok, "5535")])
    s = asyncio.run(agentic_tool_call.generate(make_input(tok, engine, agent=f"{tmp_path}/agent.py:run_agent")))
    assert s.status == SampleStatus.COMPLETED and s.metadata["num_turns"] == 1 and s.reward is None


def test_the_abort_hook_of_the_agents_module_is_called(tok):
    import sys

    fn = agentic_tool_call.load_agent_function(f"{AGENT}:run_agent")
    module = sys.modules[fn.__module__]
    before = module.aborted
    asyncio.run(agentic_tool_call.call_abort_hook(f"{AGENT}:run_agent", None))
    assert module.aborted == before + 1
