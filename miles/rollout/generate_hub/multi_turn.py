"""Multi-turn generation with tools: the model calls tools, reads their answers and goes on, in one sample.

    --custom-generate-function-path miles.rollout.generate_hub.multi_turn.generate
    --generate-tool-call-parser qwen25  --generate-max-turns 16
    --generate-tool-specs-path ...      --generate-execute-tool-function-path ...   (default: calculator, python)

Each turn sends the whole trajectory so far (prompt ids, then every earlier turn's engine ids and the
tool-answer ids between them) to the engine. The turn's text is parsed for tool calls
(`--generate-tool-call-parser`); none ends the trajectory. The calls run one after another
(`miles.rollout.tools.execution`: a failure is an `Error: ...` answer, never an exception), their answers
become `tool` messages, and the chat template's text for them (and for the next assistant opening) is
appended as ids (`chat_tokens.suffix_ids`): earlier turns are never rendered or tokenized again.

The sample is token-exact: its response is the engine's ids of every turn, with their log-probs and loss
mask 1, and between them the tool answers' template ids, with log-prob 0.0 and loss mask 0. Stops: no
tool call (completed), finish "length" or no room left under --rollout-max-context-len (truncated),
"abort" (aborted, returned at once; the rollout gives the prompt back and it restarts from its first
turn), or --generate-max-turns reached (completed; the last turn's calls are not run, as no turn would
read their answers). `metadata` gets `num_turns`, `tool_call_count` and `tool_error_count`, from which
the rollout logs rollout/num_turns, rollout/tool_call_rate and rollout/tool_error_rate.

Turn t > 0 samples with its own seed derived from the sample's, so a rerun regenerates every turn.
Fault tolerance: when an engine server dies mid-turn, the fleet sends that turn's request (same ids,
same seed) again to a live engine, so the trajectory resumes from its last complete turn.
"""

from __future__ import annotations

import dataclasses
import hashlib
import uuid
from typing import Any

from miles.rollout.engine.base import GenerateRequest
from miles.rollout.generate_hub.chat_tokens import suffix_ids
from miles.rollout.generate_hub.types import GenerateInput
from miles.rollout.tools.execution import load_execute_tool, load_tool_specs, run_tool_call, tool_name
from miles.rollout.tools.parsers import ToolCall, get_parser
from miles.sample import Sample, SampleStatus


def turn_seed(seed: int | None, turn: int) -> int | None:
    """Turn 0 keeps the sample's seed (a one-turn answer equals single-turn's); later turns get their own."""
    if seed is None or turn == 0:
        return seed
    return int.from_bytes(hashlib.sha256(f"{seed}:turn{turn}".encode()).digest()[:4], "little")


def tools_for(sample: Sample, specs_path: str | None) -> list[dict[str, Any]] | None:
    """The sample's tools: its row's (--tool-key), else --generate-tool-specs-path's, else None."""
    if sample.tools:
        return list(sample.tools)
    return load_tool_specs(specs_path)


def openai_tool_calls(calls: list[ToolCall]) -> list[dict[str, Any]]:
    """The parsed calls as an assistant message's OpenAI `tool_calls`, each with a fresh id."""
    return [
        {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": {"name": c.name or "invalid", "arguments": c.arguments}}
        for c in calls
    ]


async def generate(input: GenerateInput) -> Sample:
    """The trajectory of `input.sample` (see the module docstring), filled into the sample."""
    s, r, tok = input.sample, input.cfg.rollout, input.tokenizer
    parser = get_parser(r.generate_tool_call_parser)
    execute = load_execute_tool(r.generate_execute_tool_function_path)
    tools = tools_for(s, r.generate_tool_specs_path)
    known = {tool_name(t) for t in tools} if tools else None
    if not (s.tokens and s.response_length == 0):
        s.tokens = list(tok.encode(s.prompt, add_special_tokens=False))
    ids, mask, logprobs, texts = list(s.tokens), [], [], []
    prompt_len = len(ids)
    context = r.rollout_max_context_len
    turns = calls = errors = 0
    status = SampleStatus.COMPLETED
    for turn in range(r.generate_max_turns):
        budget = input.sampling_params.max_new_tokens
        if context is not None:
            budget = min(budget, context - len(ids))
        if budget <= 0:
            status = SampleStatus.TRUNCATED
            break
        params = dataclasses.replace(input.sampling_params, max_new_tokens=budget, seed=turn_seed(input.sampling_params.seed, turn))
        rid = None if input.rid is None else f"{input.rid}t{turn:03d}"
        resp = await input.engine.generate(GenerateRequest(input_ids=list(ids), sampling_params=params, return_logprob=True, rid=rid))
        turns += 1
        out = list(resp.output_ids)
        lps = [float(x) for x in (resp.output_token_logprobs or [])]
        if len(lps) != len(out):
            raise RuntimeError(f"the engine returned {len(lps)} log-probs for {len(out)} tokens (rid {rid})")
        ids += out
        mask += [1] * len(out)
        logprobs += lps
        texts.append(resp.text)
        s.weight_version = resp.weight_version
        if resp.finish_type == "abort":
            status = SampleStatus.ABORTED
            break
        if resp.finish_type == "length":
            status = SampleStatus.TRUNCATED
            break
        _, tool_calls = parser(resp.text)
        if not tool_calls or turn == r.generate_max_turns - 1:
            break
        messages = []
        oa_calls = openai_tool_calls(tool_calls)
        for call, oa in zip(tool_calls, oa_calls):
            answer, failed = await run_tool_call(execute, call, known)
            calls += 1
            errors += failed
            messages.append({"role": "tool", "tool_call_id": oa["id"], "name": call.name, "content": answer})
        obs = suffix_ids(tok, messages, last_output_ids=out, tools=tools, tool_calls=oa_calls)
        if context is not None and len(ids) + len(obs) >= context:
            status = SampleStatus.TRUNCATED
            break
        ids += obs
        mask += [0] * len(obs)
        logprobs += [0.0] * len(obs)
        texts.append(tok.decode(obs, skip_special_tokens=False))
    s.tokens = ids
    s.response_length = len(ids) - prompt_len
    s.response = "".join(texts)
    s.loss_mask = mask
    s.rollout_log_probs = logprobs
    s.status = status
    s.metadata = {**s.metadata, "num_turns": turns, "tool_call_count": calls, "tool_error_count": errors}
    return s
