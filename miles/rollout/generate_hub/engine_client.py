"""`EngineClient`: `await client.generate(request)` over any rollout engine, in-process or a router URL.

    client = EngineClient(engine)                          # the run's engine (built-in, or the fleet)
    client = EngineClient.from_url("http://127.0.0.1:30000")  # a router (or one server) by URL
    response = await client.generate(GenerateRequest(input_ids, sampling_params, return_logprob=True))

Requests are not sent one by one as generate functions ask: the ones asked for in one turn of the
event loop are sent together, inside the engine's `submitting_together()`, at the end of that turn.
A draw of many prompt groups, each sample in its own task, thus reaches the built-in engine's
scheduler as one batch, as if submitted in one loop.

Answers come back the other way in bursts too: an engine thread that finishes several requests at once
wakes the event loop once for all of them, not once per request (each wake-up takes the GIL from the
engine thread while it generates).
"""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import Future
from typing import TYPE_CHECKING

from miles.rollout.engine.base import GenerateRequest, GenerateResponse

if TYPE_CHECKING:
    from miles.rollout.engine.base import RolloutEngine


class _LoopSide:
    """The client's state on one event loop: requests waiting to be sent, answers waiting to be delivered."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.outbox: list[tuple[GenerateRequest, asyncio.Future]] = []
        self.inbox: list[tuple[Future, asyncio.Future]] = []
        self.inbox_lock = threading.Lock()
        self.wake_pending = False


class EngineClient:
    """The one API a generate function uses to reach the run's engines; see the module docstring."""

    def __init__(self, engine: "RolloutEngine"):
        self.engine = engine
        self._sides: dict[asyncio.AbstractEventLoop, _LoopSide] = {}
        self._aborted: set[str] = set()  # rid prefixes: requests under them are answered "abort", unsent

    @classmethod
    def from_url(cls, url: str, *, timeout_s: float = 3600.0) -> "EngineClient":
        """A client of the SGLang-compatible `/generate` at `url` (a router, an SGLang or built-in engine
        server); `timeout_s` bounds each request."""
        from miles.rollout.engine.http_client import HttpEngine

        return cls(HttpEngine(url, timeout_s=timeout_s))

    async def generate(self, request: GenerateRequest) -> GenerateResponse:
        """The engine's answer to `request` (finish "abort" when the rollout aborted it)."""
        side = self._side()
        answer = side.loop.create_future()
        if not side.outbox:
            side.loop.call_soon(self._send, side)
        side.outbox.append((request, answer))
        return await answer

    async def abort(self, rid_prefix: str) -> None:
        """End every request whose rid starts with `rid_prefix` with finish "abort": those in flight,
        those not sent yet, and those asked for later (a multi-turn function's next turn)."""
        self._aborted.add(rid_prefix)
        side = self._side()
        keep = []
        for request, answer in side.outbox:
            if (request.rid or "").startswith(rid_prefix):
                if not answer.done():
                    answer.set_result(_aborted_response(request))
            else:
                keep.append((request, answer))
        side.outbox = keep
        await side.loop.run_in_executor(None, lambda: self.engine.abort_request(rid_prefix))

    def _side(self) -> _LoopSide:
        loop = asyncio.get_running_loop()
        side = self._sides.get(loop)
        if side is None:
            # One entry per loop: the rollout manager runs one `asyncio.run` per step; closed loops go.
            self._sides = {k: v for k, v in self._sides.items() if not k.is_closed()}
            side = self._sides[loop] = _LoopSide(loop)
        return side

    def _send(self, side: _LoopSide) -> None:
        batch, side.outbox = side.outbox, []
        with self.engine.submitting_together():
            for request, answer in batch:
                if answer.done():  # its waiter was cancelled before it went out
                    continue
                if self._aborted and request.rid and any(request.rid.startswith(p) for p in self._aborted):
                    answer.set_result(_aborted_response(request))
                    continue
                try:
                    future = self.engine.submit(request)
                except Exception as e:  # noqa: BLE001 - e.g. a sampling setting the engine rejects: that request's error
                    answer.set_exception(e)
                    continue
                future.add_done_callback(lambda f, a=answer: self._arrived(side, f, a))

    def _arrived(self, side: _LoopSide, future: Future, answer: asyncio.Future) -> None:
        # Runs on the engine's thread (or this loop's, when the answer was already there).
        with side.inbox_lock:
            side.inbox.append((future, answer))
            if side.wake_pending:
                return
            side.wake_pending = True
        try:
            side.loop.call_soon_threadsafe(self._deliver, side)
        except RuntimeError:  # the loop has closed: nobody waits for this answer any more
            pass

    @staticmethod
    def _deliver(side: _LoopSide) -> None:
        with side.inbox_lock:
            arrived, side.inbox = side.inbox, []
            side.wake_pending = False
        for future, answer in arrived:
            if answer.done():  # its waiter was cancelled
                continue
            if future.cancelled():
                answer.cancel()
            elif future.exception() is not None:
                answer.set_exception(future.exception())
            else:
                answer.set_result(future.result())


def _aborted_response(request: GenerateRequest) -> GenerateResponse:
    """What an engine answers for a request aborted before it produced a token."""
    return GenerateResponse(output_ids=[], text="", finish_type="abort", prompt_tokens=len(request.input_ids), rid=request.rid)
