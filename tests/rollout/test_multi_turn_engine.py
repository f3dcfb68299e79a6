"""Multi-turn generation with the built-in engine: a tiny chat model taught one tool conversation calls the
calculator, reads its answer and replies; the trajectory is the engine's tokens, and the model scores
them with the log-probs the engine returned (two implementations: a tolerance)."""

from __future__ import annotations

import asyncio
import dataclasses
from types import SimpleNamespace

import pytest
import torch

from miles.config.rollout import RolloutConfig
from miles.rollout.engine.base import SamplingParams
from miles.rollout.generate_hub import EngineClient, GenerateInput, multi_turn
from miles.rollout.tools.builtin import TOOL_SPECS
from miles.sample import Sample, SampleStatus

QUESTION = "What is 123*45?"
CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "123*45"}}</tool_call>'


@pytest.fixture(scope="module")
def taught(tmp_path_factory):
    """The tiny chat model after memorising one tool-using conversation (loss on assistant tokens only)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from miles.prepare.tiny_model import create_tiny_qwen3

    base = create_tiny_qwen3(tmp_path_factory.mktemp("m") / "base", chat=True, seed=0)
    tok = AutoTokenizer.from_pretrained(base, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(base, local_files_only=True)
    convo = [{"role": "user", "content": QUESTION},
             {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "calculator", "arguments": {"expression": "123*45"}}}]},
             {"role": "tool", "content": "5535"}, {"role": "assistant", "content": "5535"}]
    text = tok.apply_chat_template(convo, tools=TOOL_SPECS, tokenize=False)
    ids = tok.encode(text, add_special_tokens=False)
    prompt = tok.encode(tok.apply_chat_template(convo[:1], tools=TOOL_SPECS, tokenize=False, add_generation_prompt=True), add_special_tokens=False)
    labels = torch.full((len(ids),), -100)
    labels[len(prompt):] = torch.tensor(ids[len(prompt):])
    torch.manual_seed(0)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    x = torch.tensor([ids])
    for _ in range(300):
        loss = model(input_ids=x, labels=labels[None]).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        if loss.item() < 0.01:
            break
    out = tmp_path_factory.mktemp("m") / "taught"
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def test_the_built_in_engine_runs_a_tool_conversation_token_exactly(taught):
    from transformers import AutoModelForCausalLM

    from miles.rollout.engine.builtin import BuiltinEngine

    engine = BuiltinEngine(taught, seed=0)
    tok = engine.tokenizer
    text = tok.apply_chat_template([{"role": "user", "content": QUESTION}], tools=TOOL_SPECS, tokenize=False, add_generation_prompt=True)
    sample = Sample(prompt=text, tokens=tok.encode(text, add_special_tokens=False), index=0, group_index=0, tools=TOOL_SPECS)
    cfg = SimpleNamespace(rollout=dataclasses.replace(RolloutConfig(), generate_max_turns=4))
    inp = GenerateInput(sample=sample, sampling_params=SamplingParams(temperature=0.0, max_new_tokens=120, seed=1, skip_special_tokens=False),
                        engine=EngineClient(engine), cfg=cfg, tokenizer=tok, rollout_id=0, rid="r-")  # type: ignore[arg-type]
    try:
        s = asyncio.run(multi_turn.generate(inp))
    finally:
        engine.shutdown() if hasattr(engine, "shutdown") else None
    assert s.metadata["tool_call_count"] == 1 and s.metadata["tool_error_count"] == 0, s.response
    assert s.status == SampleStatus.COMPLETED and s.metadata["num_turns"] == 2
    assert CALL in s.response and "<tool_response>5535</tool_response>" in s.response
    model = AutoModelForCausalLM.from_pretrained(taught, local_files_only=True)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([s.tokens])).logits[0].float()
    lp = torch.log_softmax(logits[:-1], -1).gather(-1, torch.tensor(s.tokens[1:])[:, None])[:, 0]
    resp_lp = lp[-s.response_length:]
    mask = torch.tensor(s.loss_mask, dtype=torch.bool)
    # Greedy: the engine's log-probs are log_softmax(logits) at T = 1; the model agrees on every trained token.
    assert torch.allclose(resp_lp[mask], torch.tensor(s.rollout_log_probs)[mask], atol=1e-4)
    assert all(x == 0.0 for x, m in zip(s.rollout_log_probs, s.loss_mask) if not m)
