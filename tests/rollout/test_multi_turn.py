"""Multi-turn generation with tools, against a scripted engine and the tiny chat tokenizer.

The engine answers each turn with ids the test chose, some of them not the tokenizer's canonical ids
for their text (the tool tag spelled out character by character), so a trajectory rebuilt from text
differs from the one the engine produced and the token-exactness tests see it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from types import SimpleNamespace

import pytest

from miles.config.rollout import RolloutConfig
from miles.rollout.engine.base import GenerateResponse, SamplingParams
from miles.rollout.generate_hub import GenerateInput
from miles.rollout.generate_hub import multi_turn
from miles.rollout.generate_hub.chat_tokens import suffix_ids
from miles.rollout.generate_hub.turn_metrics import turn_metrics
from miles.rollout.tools.builtin import TOOL_SPECS
from miles.sample import Sample, SampleStatus


@pytest.fixture(scope="module")
def tok():
    from miles.prepare.tiny_model import build_chat_tokenizer

    return build_chat_tokenizer()


def spelled(tok, text: str) -> list[int]:
    """`text` as one id per character, even where the tokenizer has one id for a tag (non-canonical)."""
    return [tok.convert_tokens_to_ids(c) for c in text]


class ScriptedEngine:
    """An `EngineClient` stand-in: turn t answers with `turns[t]` (ids), log-probs unique per token."""

    def __init__(self, tok, turns: list[list[int]], finishes: list[str] | None = None):
        self.tok, self.turns, self.finishes = tok, turns, finishes or ["stop"] * len(turns)
        self.requests = []
        self.logprobs: list[list[float]] = []

    async def generate(self, request):
        t = len(self.requests)
        self.requests.append(request)
        ids = self.turns[t][: request.sampling_params.max_new_tokens]
        lps = [-(t + 1) / 10 - i / 1000 for i in range(len(ids))]
        self.logprobs.append(lps)
        return GenerateResponse(output_ids=ids, text=self.tok.decode(ids, skip_special_tokens=False).replace("<|im_end|>", ""),
                                finish_type=self.finishes[t], prompt_tokens=len(request.input_ids),
                                weight_version=7, output_token_logprobs=lps, rid=request.rid)


def call(tok, name: str, args: dict, *, spell: bool = False) -> list[int]:
    text = "<tool_call>" + json.dumps({"name": name, "arguments": args}) + "</tool_call>"
    return (spelled(tok, text) if spell else tok.encode(text, add_special_tokens=False)) + [tok.eos_token_id]


def answer(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]


def make_input(tok, engine, *, prompt="What is 123*45?", tools=TOOL_SPECS, context=None, **rollout) -> GenerateInput:
    text = tok.apply_chat_template([{"role": "user", "content": prompt}], tools=tools, tokenize=False, add_generation_prompt=True)
    sample = Sample(prompt=text, tokens=tok.encode(text, add_special_tokens=False), index=0, group_index=0, tools=tools)
    cfg = SimpleNamespace(rollout=dataclasses.replace(RolloutConfig(), rollout_max_context_len=context, **rollout))
    return GenerateInput(sample=sample, sampling_params=SamplingParams(max_new_tokens=200, seed=5), engine=engine,  # type: ignore[arg-type]
                         cfg=cfg, tokenizer=tok, rollout_id=0, rid="r-")  # type: ignore[arg-type]


def three_turns(tok):
    return [call(tok, "calculator", {"expression": "123*45"}, spell=True),
            call(tok, "python", {"code": "print(5535 + 1)"}),
            answer(tok, "The answer is 5535.")]


def run(coro):
    return asyncio.run(coro)


def test_three_turns_train_exactly_the_engines_tokens_and_log_probs(tok):
    engine = ScriptedEngine(tok, three_turns(tok))
    inp = make_input(tok, engine)
    prompt = list(inp.sample.tokens)
    s = run(multi_turn.generate(inp))
    assert s.status == SampleStatus.COMPLETED and s.metadata["num_turns"] == 3
    assert s.metadata["tool_call_count"] == 2 and s.metadata["tool_error_count"] == 0
    # Each request is exactly the trajectory so far: the engine's earlier ids are never re-tokenised.
    for req, turn_end in zip(engine.requests, range(3)):
        assert s.tokens[: len(req.input_ids)] == req.input_ids
    assert engine.requests[0].input_ids == prompt
    resp = s.response_tokens
    assert len(resp) == len(s.loss_mask) == len(s.rollout_log_probs) == s.response_length
    trained = [t for t, m in zip(resp, s.loss_mask) if m]
    assert trained == [t for turn in engine.turns for t in turn]
    assert [lp for lp, m in zip(s.rollout_log_probs, s.loss_mask) if m] == [x for lps in engine.logprobs for x in lps]
    # What the second request sent after turn 1 is turn 1's ids verbatim, spelled-out tag included.
    start = len(prompt)
    assert engine.requests[1].input_ids[start : start + len(engine.turns[0])] == engine.turns[0]
    # Re-tokenising the decoded history would give other ids (the spelled tag becomes one token).
    assert tok.encode(tok.decode(s.tokens, skip_special_tokens=False), add_special_tokens=False) != s.tokens
    assert s.weight_version == 7 and "5535" in s.response and "5536" in s.response


def test_tool_answers_and_template_tokens_are_masked(tok):
    engine = ScriptedEngine(tok, three_turns(tok))
    s = run(multi_turn.generate(make_input(tok, engine)))
    resp, mask = s.response_tokens, s.loss_mask
    masked = tok.decode([t for t, m in zip(resp, mask) if not m], skip_special_tokens=False)
    assert masked.count("<tool_response>") == 2 and "5535" in masked and "5536" in masked
    assert masked.count("<|im_start|>assistant\n") == 2  # the template's openings of turns 2 and 3
    # Masked spans are exactly what lies between the engine's turns.
    spans, cur = [], None
    for i, m in enumerate(mask):
        if m == 0 and cur is None:
            cur = i
        if m == 1 and cur is not None:
            spans.append((cur, i)); cur = None
    assert len(spans) == 2 and all(s.rollout_log_probs[i] == 0.0 for a, b in spans for i in range(a, b))
    # The observation ids are what a full render of the conversation puts there.
    obs = resp[spans[0][0] : spans[0][1]]
    full = tok.apply_chat_template(
        [{"role": "user", "content": "What is 123*45?"},
         {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "calculator", "arguments": {"expression": "123*45"}}}]},
         {"role": "tool", "content": "5535"}], tools=TOOL_SPECS, tokenize=False, add_generation_prompt=True)
    assert full.endswith("<|im_end|>" + tok.decode(obs, skip_special_tokens=False))


@pytest.mark.parametrize(
    "turn, error",
    [
        ("<tool_call>{not json</tool_call>", "not valid JSON"),
        ('<tool_call>{"name": "teleport", "arguments": {}}</tool_call>', "unknown tool 'teleport'"),
        ('<tool_call>{"name": "calculator", "arguments": {"expression": "1/0"}}</tool_call>', "division by zero"),
        ('<tool_call>{"name": "calculator", "arguments": {"x": 1}}</tool_call>', "takes one argument"),
        ('<tool_call>["calculator"]</tool_call>', "must be a JSON object"),
    ],
)
def test_each_bad_tool_call_becomes_an_error_the_model_reads(tok, turn, error):
    engine = ScriptedEngine(tok, [tok.encode(turn, add_special_tokens=False) + [tok.eos_token_id], answer(tok, "ok")])
    s = run(multi_turn.generate(make_input(tok, engine)))
    assert s.status == SampleStatus.COMPLETED and s.metadata["num_turns"] == 2
    assert s.metadata["tool_error_count"] == 1
    second_prompt = tok.decode(engine.requests[1].input_ids, skip_special_tokens=False)
    assert "<tool_response>Error: " in second_prompt and error in second_prompt


def test_a_tool_that_raises_or_returns_no_text_is_an_error_not_a_crash(tok, tmp_path):
    (tmp_path / "tools.py").write_text(
        "async def execute(name, params):\n"
        "    if name == 'boom':\n        raise RuntimeError('kaboom')\n"
        "    if name == 'obj':\n        return object()\n"
        "    return {'sum': params['a'] + params['b']}\n"
    )
    turns = [call(tok, "boom", {}), call(tok, "obj", {}), call(tok, "add", {"a": 1, "b": 2}), answer(tok, "3")]
    engine = ScriptedEngine(tok, turns)
    inp = make_input(tok, engine, tools=None, generate_execute_tool_function_path=f"{tmp_path}/tools.py:execute")
    s = run(multi_turn.generate(inp))
    assert s.metadata["tool_call_count"] == 3 and s.metadata["tool_error_count"] == 2
    last = tok.decode(engine.requests[3].input_ids, skip_special_tokens=False)
    assert "RuntimeError: kaboom" in last and "returned a object" in last and '{"sum": 3}' in last


def test_turn_limit_length_and_context_stop_the_trajectory(tok):
    loop = [call(tok, "calculator", {"expression": "1+1"})] * 5
    s = run(multi_turn.generate(make_input(tok, ScriptedEngine(tok, loop), generate_max_turns=2)))
    assert s.metadata["num_turns"] == 2 and s.metadata["tool_call_count"] == 1 and s.status == SampleStatus.COMPLETED
    assert s.loss_mask[-1] == 1  # ends on the model's own turn: the last calls are not run
    s = run(multi_turn.generate(make_input(tok, ScriptedEngine(tok, loop, ["stop", "length"]))))
    assert s.status == SampleStatus.TRUNCATED and s.metadata["num_turns"] == 2
    inp = make_input(tok, ScriptedEngine(tok, loop))
    ctx = len(inp.sample.tokens) + len(loop[0]) + 10
    s = run(multi_turn.generate(dataclasses.replace(inp, cfg=SimpleNamespace(rollout=dataclasses.replace(inp.cfg.rollout, rollout_max_context_len=ctx)))))
    assert s.status == SampleStatus.TRUNCATED and len(s.tokens) <= ctx


def test_abort_returns_at_once_with_what_was_generated(tok):
    engine = ScriptedEngine(tok, three_turns(tok), ["stop", "abort", "stop"])
    s = run(multi_turn.generate(make_input(tok, engine)))
    assert s.status == SampleStatus.ABORTED and len(engine.requests) == 2


def test_turns_have_their_own_seeds_and_rids(tok):
    engine = ScriptedEngine(tok, three_turns(tok))
    run(multi_turn.generate(make_input(tok, engine)))
    assert [r.rid for r in engine.requests] == ["r-t000", "r-t001", "r-t002"]
    seeds = [r.sampling_params.seed for r in engine.requests]
    assert seeds[0] == 5 and len(set(seeds)) == 3


def test_suffix_of_a_turn_without_eos_starts_with_eos(tok):
    ids = suffix_ids(tok, [{"role": "tool", "content": "4"}], last_output_ids=[10, 11])
    assert ids[0] == tok.eos_token_id
    assert tok.decode(ids, skip_special_tokens=False) == "<|im_end|>\n<|im_start|>user\n<tool_response>4</tool_response><|im_end|>\n<|im_start|>assistant\n"


def test_turn_metrics():
    a = Sample(metadata={"num_turns": 3, "tool_call_count": 2, "tool_error_count": 1})
    b = Sample(metadata={"num_turns": 1, "tool_call_count": 0, "tool_error_count": 0})
    assert turn_metrics([a, b], "rollout") == {"rollout/num_turns": 2.0, "rollout/tool_call_rate": 0.5, "rollout/tool_error_rate": 0.5}
    assert turn_metrics([Sample()], "rollout") == {}
