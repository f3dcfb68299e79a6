"""The session server: an OpenAI-compatible chat endpoint per rollout session, with miles owning the tokens.

    POST {url}/sessions/{id}/v1/chat/completions   {"messages": [...], "tools": [...], "max_tokens": ...}
    GET  {url}/health

An agent (`--custom-agent-function-path`) sends whole message histories, as to any OpenAI server. Miles
does not render them again: the first request is rendered once with the tokenizer's chat template
(generation prompt included); every later request must repeat the session's history (the messages sent
before and the assistant messages this server answered) and add only new, non-assistant messages
(tool results, a user's next message), whose template text after the last assistant turn is appended as
ids (`chat_tokens.suffix_ids`). Each turn's prompt is the session's token ids so far, and what the engine
returns is appended as it is: the session's record is the engine's ids with their log-probs (loss mask
1) and the appended ids between turns (loss mask 0): token in, token out.

Sampling settings are the rollout's (the trainer scores that policy, so an agent's `temperature` or
`top_p` is not applied); `max_tokens` (at most --rollout-max-response-len) and `stop` are. Errors: 404
unknown session, 400 a history that does not extend the session's (or adds an assistant message),
503 the session was aborted (the rollout had enough groups), 500 the template cannot extend a render.

The server runs on its own thread and event loop, on 127.0.0.1 and a free port, one per process; it
reaches the engines through the rollout's `EngineClient`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import threading
import time
import uuid
from typing import Any

from miles.rollout.engine.base import GenerateRequest, SamplingParams
from miles.rollout.generate_hub.chat_tokens import TemplateMismatch, prompt_ids, suffix_ids
from miles.rollout.generate_hub.multi_turn import turn_seed
from miles.rollout.tools.parsers import get_parser

logger = logging.getLogger(__name__)
START_TIMEOUT_S = 30.0


@dataclasses.dataclass
class SessionRecord:
    """What one session produced: the ids the engine saw and returned, and how to train on them."""

    prompt_ids: list[int] = dataclasses.field(default_factory=list)
    response_ids: list[int] = dataclasses.field(default_factory=list)
    loss_mask: list[int] = dataclasses.field(default_factory=list)
    log_probs: list[float] = dataclasses.field(default_factory=list)
    texts: list[str] = dataclasses.field(default_factory=list)
    turns: int = 0
    tool_call_count: int = 0
    finish: str | None = None
    """The last turn's finish: stop, length or abort (None: no turn)."""
    weight_version: int | None = None


@dataclasses.dataclass
class _Session:
    rid: str | None
    params: SamplingParams
    tools: list[dict[str, Any]] | None
    max_context: int | None
    record: SessionRecord = dataclasses.field(default_factory=SessionRecord)
    messages: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    last_output: list[int] = dataclasses.field(default_factory=list)
    last_calls: list[dict[str, Any]] | None = None
    lock: asyncio.Lock | None = None


class HttpError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


def _same_message(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether a history message repeats a stored one (role, text and called tool names; arguments may be
    re-serialised by the client)."""
    if a.get("role") != b.get("role") or (a.get("content") or "") != (b.get("content") or ""):
        return False
    names = lambda m: [(c.get("function") or {}).get("name") for c in (m.get("tool_calls") or [])]  # noqa: E731
    return names(a) == names(b)


class SessionServer:
    """See the module docstring. `open()`/`close()` are called from any thread."""

    def __init__(self, engine: Any, tokenizer: Any, *, tool_call_parser: str = "qwen25", host: str = "127.0.0.1"):
        self.engine, self.tokenizer, self.host = engine, tokenizer, host
        self.parser = get_parser(tool_call_parser)
        self._sessions: dict[str, _Session] = {}
        self._lock = threading.Lock()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self.port: int | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=self._serve, name="miles-session-server", daemon=True)
        self._thread.start()
        if not self._ready.wait(START_TIMEOUT_S):
            raise TimeoutError(f"the session server did not start listening on {host} within {START_TIMEOUT_S:g} s")
        if self._error is not None:
            raise RuntimeError(f"the session server could not start: {self._error}") from self._error

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    # ------------------------------------------------------------------ sessions
    def open(self, *, rid: str | None, params: SamplingParams, tools: list[dict[str, Any]] | None, max_context: int | None) -> str:
        sid = uuid.uuid4().hex
        with self._lock:
            self._sessions[sid] = _Session(rid=rid, params=params, tools=tools, max_context=max_context)
        return sid

    def close(self, sid: str) -> SessionRecord:
        with self._lock:
            return self._sessions.pop(sid).record

    def stop(self) -> None:
        if self.loop is not None and self.loop.is_running():
            self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)

    # ------------------------------------------------------------------ serving
    def _serve(self) -> None:
        from aiohttp import web

        self.loop = asyncio.new_event_loop()
        asyncio.set_event_loop(self.loop)
        app = web.Application(client_max_size=64 * 1024**2)
        async def health(_request):
            return web.json_response({"status": "ok"})

        app.router.add_get("/health", health)
        app.router.add_post("/sessions/{sid}/v1/chat/completions", self._chat_handler)
        runner = web.AppRunner(app, access_log=None)
        try:
            self.loop.run_until_complete(runner.setup())
            site = web.TCPSite(runner, self.host, 0)
            self.loop.run_until_complete(site.start())
            self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        except BaseException as e:  # noqa: BLE001 - reported to the constructor's caller
            self._error = e
            self._ready.set()
            return
        self._ready.set()
        try:
            self.loop.run_forever()
        finally:
            self.loop.run_until_complete(runner.cleanup())
            self.loop.close()

    async def _chat_handler(self, request):
        from aiohttp import web

        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            return web.json_response({"error": {"message": "the body is not JSON"}}, status=400)
        try:
            return web.json_response(await self.chat(request.match_info["sid"], body))
        except HttpError as e:
            return web.json_response({"error": {"message": e.message}}, status=e.status)

    async def chat(self, sid: str, body: dict[str, Any]) -> dict[str, Any]:
        """One chat completion of session `sid` (see the module docstring)."""
        with self._lock:
            session = self._sessions.get(sid)
        if session is None:
            raise HttpError(404, f"no session {sid}")
        if session.lock is None:
            session.lock = asyncio.Lock()
        async with session.lock:  # one turn at a time: the next turn extends this one's ids
            return await self._turn(session, body)

    async def _turn(self, session: _Session, body: dict[str, Any]) -> dict[str, Any]:
        rec, tok = session.record, self.tokenizer
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) and "role" in m for m in messages):
            raise HttpError(400, "messages must be a non-empty list of {role, content} objects")
        if rec.finish == "abort":
            raise HttpError(503, "the session was aborted")
        try:
            if not session.messages:
                session.tools = body.get("tools") or session.tools
                rec.prompt_ids = prompt_ids(tok, messages, tools=session.tools)
                new_ids: list[int] = []
            else:
                stored = session.messages
                if len(messages) <= len(stored) or not all(_same_message(a, b) for a, b in zip(messages, stored)):
                    raise HttpError(400, "the messages must repeat the session's history and add new messages after it")
                new = messages[len(stored):]
                if any(m.get("role") == "assistant" for m in new):
                    raise HttpError(400, "new messages cannot be assistant messages: those come from the engine")
                new_ids = suffix_ids(tok, new, last_output_ids=session.last_output, tools=session.tools, tool_calls=session.last_calls)
        except TemplateMismatch as e:
            raise HttpError(500, f"the chat template cannot extend this conversation token-exactly: {e}") from None
        ids = rec.prompt_ids + rec.response_ids + new_ids
        budget = session.params.max_new_tokens
        if isinstance(body.get("max_tokens"), int):
            budget = min(budget, body["max_tokens"])
        if session.max_context is not None:
            budget = min(budget, session.max_context - len(ids))
        if budget <= 0:
            raise HttpError(400, f"the conversation has {len(ids)} tokens: no room for a reply under --rollout-max-context-len")
        stop = body.get("stop")
        params = dataclasses.replace(
            session.params, max_new_tokens=budget, seed=turn_seed(session.params.seed, rec.turns),
            stop=([stop] if isinstance(stop, str) else list(stop)) if stop else session.params.stop,
        )
        rid = None if session.rid is None else f"{session.rid}t{rec.turns:03d}"
        resp = await self.engine.generate(GenerateRequest(input_ids=ids, sampling_params=params, return_logprob=True, rid=rid))
        out = list(resp.output_ids)
        lps = [float(x) for x in (resp.output_token_logprobs or [])]
        if len(lps) != len(out):
            raise HttpError(502, f"the engine returned {len(lps)} log-probs for {len(out)} tokens")
        rec.response_ids += new_ids + out
        rec.loss_mask += [0] * len(new_ids) + [1] * len(out)
        rec.log_probs += [0.0] * len(new_ids) + lps
        if new_ids:
            rec.texts.append(tok.decode(new_ids, skip_special_tokens=False))
        rec.texts.append(resp.text)
        rec.turns += 1
        rec.finish = resp.finish_type
        rec.weight_version = resp.weight_version
        if resp.finish_type == "abort":
            raise HttpError(503, "the session was aborted")
        content, calls = self.parser(resp.text)
        calls = [c for c in calls if c.error is None]
        tool_calls = [
            {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": {"name": c.name, "arguments": json.dumps(c.arguments)}}
            for c in calls
        ]
        rec.tool_call_count += len(tool_calls)
        reply: dict[str, Any] = {"role": "assistant", "content": content if tool_calls else resp.text}
        if tool_calls:
            reply["tool_calls"] = tool_calls
        session.messages = list(messages) + [reply]
        session.last_output, session.last_calls = out, tool_calls or None
        finish = "length" if resp.finish_type == "length" else ("tool_calls" if tool_calls else "stop")
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex[:24]}", "object": "chat.completion", "created": int(time.time()),
            "model": "miles", "choices": [{"index": 0, "message": reply, "finish_reason": finish, "logprobs": None}],
            "usage": {"prompt_tokens": len(ids), "completion_tokens": len(out), "total_tokens": len(ids) + len(out)},
        }


_SERVERS: dict[tuple[int, int], SessionServer] = {}
_SERVERS_LOCK = threading.Lock()


def session_server(engine: Any, tokenizer: Any, *, tool_call_parser: str) -> SessionServer:
    """The process's session server for this engine client and tokenizer (started on first use)."""
    key = (id(engine), id(tokenizer))
    with _SERVERS_LOCK:
        server = _SERVERS.get(key)
        if server is None or server.engine is not engine or server.tokenizer is not tokenizer:  # ids reused after GC
            server = _SERVERS[key] = SessionServer(engine, tokenizer, tool_call_parser=tool_call_parser)
            logger.info("session server listening on %s", server.url)
        return server
