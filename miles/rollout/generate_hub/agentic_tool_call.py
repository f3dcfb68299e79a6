"""Agentic generation: the user's agent drives a conversation through miles' session endpoint.

    --custom-generate-function-path miles.rollout.generate_hub.agentic_tool_call.generate
    --custom-agent-function-path my_agent.run_agent   --use-session-server

For each sample a session is opened on the session server (`session_server.py`) and the agent is called:

    async def run_agent(base_url, prompt, request_kwargs, metadata, **kw) -> dict | None

- `base_url` ends in `/sessions/<id>`: POST `{base_url}/v1/chat/completions` with whole message histories,
  as to any OpenAI-compatible server; run the tools yourself and send their results as `tool` messages.
- `prompt`: the sample's chat messages (a text prompt becomes one user message; so no --apply-chat-template).
- `request_kwargs`: the rollout's sampling settings in OpenAI names (`max_tokens`, `temperature`, `top_p`,
  `seed`, `stop`); send them on (the server applies the rollout's own anyway).
- `metadata`: a copy of the sample's metadata (the dataset row's).

It may return a dict: `reward` becomes the sample's reward (the one trained on; else --rm-type /
--custom-rm-path scores it), the other keys join the sample's metadata. The sample is the session's
record (token-exact: the engine's ids and log-probs, loss mask 0 between turns); an agent that raises is
logged and its sample keeps what the session produced; a session without a turn, or whose last turn was
aborted, is an aborted sample (the rollout gives it back and it restarts from scratch).

An `async def abort(cfg)` in the agent's module, when there is one, is called when the rollout aborts
what is still in flight (over-sampling); its errors are logged.
"""

from __future__ import annotations

import functools
import inspect
import logging
import sys
from typing import Any, Awaitable, Callable

from miles.errors import UserError
from miles.rollout.generate_hub.multi_turn import tools_for
from miles.rollout.generate_hub.session_server import session_server
from miles.rollout.generate_hub.types import GenerateInput
from miles.sample import Sample, SampleStatus
from miles.utils.load_function import load_function

logger = logging.getLogger(__name__)
AGENT_FLAG = "--custom-agent-function-path"
_STATUS = {"stop": SampleStatus.COMPLETED, "length": SampleStatus.TRUNCATED, "abort": SampleStatus.ABORTED}


@functools.lru_cache(maxsize=None)
def load_agent_function(path: str) -> Callable[..., Awaitable[Any]]:
    """The agent `path` names; exit 2 unless it is an async function."""
    fn = load_function(path, flag=AGENT_FLAG)
    if inspect.isclass(fn) or not (inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))):
        raise UserError(
            f"{AGENT_FLAG} {path} is not an async function; it must name "
            "`async def run_agent(base_url, prompt, request_kwargs, metadata, **kw) -> dict | None`.",
            option=AGENT_FLAG,
        )
    return fn


async def call_abort_hook(path: str | None, cfg: Any) -> None:
    """The agent module's `abort(cfg)` hook, if it has one (errors logged, never raised)."""
    if not path:
        return
    module = sys.modules.get(getattr(load_agent_function(path), "__module__", ""), None)
    hook = getattr(module, "abort", None)
    if hook is None:
        return
    try:
        out = hook(cfg)
        if inspect.isawaitable(out):
            await out
    except Exception:  # noqa: BLE001 - an agent's cleanup must not fail the rollout
        logger.exception("the abort hook of %s failed", path)


def _messages(prompt: Any) -> list[dict[str, Any]]:
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    return [dict(m) for m in prompt]


async def generate(input: GenerateInput) -> Sample:
    """One agent run for `input.sample` (see the module docstring); the sample, filled in place."""
    s, r = input.sample, input.cfg.rollout
    agent = load_agent_function(r.custom_agent_function_path)
    server = session_server(input.engine, input.tokenizer, tool_call_parser=r.generate_tool_call_parser)
    p = input.sampling_params
    sid = server.open(rid=input.rid, params=p, tools=tools_for(s, r.generate_tool_specs_path), max_context=r.rollout_max_context_len)
    request_kwargs = {"max_tokens": p.max_new_tokens, "temperature": p.temperature, "top_p": p.top_p, "seed": p.seed}
    if p.stop:
        request_kwargs["stop"] = list(p.stop)
    result = None
    try:
        result = await agent(base_url=f"{server.url}/sessions/{sid}", prompt=_messages(s.prompt),
                             request_kwargs={k: v for k, v in request_kwargs.items() if v is not None}, metadata=dict(s.metadata))
    except Exception:  # noqa: BLE001 - the agent's bug costs its sample's later turns, not the run
        logger.exception("the agent %s raised for sample %s; its sample keeps what the session produced", r.custom_agent_function_path, s.index)
    finally:
        rec = server.close(sid)
    if rec.turns:
        s.tokens = rec.prompt_ids + rec.response_ids
        s.response_length = len(rec.response_ids)
        s.loss_mask, s.rollout_log_probs = rec.loss_mask, rec.log_probs
        s.response = "".join(rec.texts)
        s.weight_version = rec.weight_version
    s.status = _STATUS.get(rec.finish or "abort", SampleStatus.ABORTED)
    meta = {**s.metadata, "num_turns": rec.turns, "tool_call_count": rec.tool_call_count, "tool_error_count": 0}
    if isinstance(result, dict):
        result = dict(result)
        if "reward" in result:
            s.reward = result.pop("reward")
        meta.update(result)
    s.metadata = meta
    return s
