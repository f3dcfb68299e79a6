"""`HttpEngine`: the `RolloutEngine` API over SGLang's HTTP API (a built-in engine server or SGLang).

Generation is asynchronous per request: `submit` sends one `/generate` from a background asyncio loop
(one aiohttp session, many requests in flight) and returns a `concurrent.futures.Future`. Control calls
(pause, weight-update session, abort, flush, memory, health) are plain blocking POSTs to the engine
itself, never to a router (sglang-router does not forward them).

    engine = HttpEngine("http://127.0.0.1:31001")
    resp = engine.submit(GenerateRequest([1, 2, 3], SamplingParams(max_new_tokens=4), True)).result()
"""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import Future
from typing import Any

from miles.rollout.engine.base import GenerateRequest, GenerateResponse, RolloutEngine


class EngineHTTPError(RuntimeError):
    """A request to an engine (or the router) failed: connection refused/reset or an HTTP error."""

    def __init__(self, message: str, *, status: int | None = None):
        super().__init__(message)
        self.status = status


class _Loop:
    """One background asyncio loop + aiohttp session shared by every HttpEngine in the process."""

    _lock = threading.Lock()
    _instance: "_Loop | None" = None

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self._session = None
        threading.Thread(target=self.loop.run_forever, name="miles-http-client", daemon=True).start()

    @classmethod
    def get(cls) -> "_Loop":
        with cls._lock:
            if cls._instance is None:
                cls._instance = cls()
            return cls._instance

    async def session(self):
        import aiohttp

        if self._session is None or self._session.closed:
            # No connection cap: the engine's own batching decides how many run at once.
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        return self._session


class HttpEngine(RolloutEngine):
    """One engine server. `generate_url` (default: the engine itself) may point at a router."""

    def __init__(self, url: str, *, generate_url: str | None = None, timeout_s: float = 3600.0, control_timeout_s: float = 600.0):
        self.url = url.rstrip("/")
        self.generate_url = (generate_url or url).rstrip("/")
        self.timeout_s = timeout_s
        self.control_timeout_s = control_timeout_s
        self._loop = _Loop.get()

    # ------------------------------------------------------------------ generation
    def submit(self, request: GenerateRequest) -> "Future[GenerateResponse]":
        return asyncio.run_coroutine_threadsafe(self._generate(request), self._loop.loop)

    async def _generate(self, request: GenerateRequest) -> GenerateResponse:
        import aiohttp

        session = await self._loop.session()
        url = f"{self.generate_url}/generate"
        try:
            async with session.post(url, json=request.to_json(), timeout=aiohttp.ClientTimeout(total=self.timeout_s)) as r:
                if r.status != 200:
                    raise EngineHTTPError(f"{url} answered HTTP {r.status}: {(await r.text())[:300]}", status=r.status)
                data = await r.json(content_type=None)
        except (aiohttp.ClientError, asyncio.TimeoutError, ConnectionError) as e:
            raise EngineHTTPError(f"{url} failed: {type(e).__name__}: {e}") from e
        resp = GenerateResponse.from_sglang_json(data)
        if resp.rid is None:
            resp.rid = request.rid
        return resp

    # ------------------------------------------------------------------ control
    def call(self, path: str, body: dict[str, Any] | None = None, *, method: str = "POST", timeout: float | None = None) -> Any:
        import requests

        url = f"{self.url}{path}"
        try:
            r = requests.request(method, url, json=body if method == "POST" else None, timeout=timeout or self.control_timeout_s)
        except requests.RequestException as e:
            raise EngineHTTPError(f"{url} failed: {type(e).__name__}: {e}") from e
        if r.status_code != 200:
            raise EngineHTTPError(f"{url} answered HTTP {r.status_code}: {r.text[:300]}", status=r.status_code)
        # SGLang answers some control calls with plain text (/flush_cache) or an empty body (/abort_request).
        data = r.json() if r.content and "json" in r.headers.get("content-type", "") else (r.text or None)
        if isinstance(data, dict) and data.get("success") is False:
            raise EngineHTTPError(f"{url} failed: {data.get('message')}")
        return data

    def abort_request(self, rid: str = "", abort_all: bool = False) -> None:
        self.call("/abort_request", {"rid": rid, "abort_all": abort_all})

    def pause_generation(self) -> None:
        self.call("/pause_generation", {"mode": "abort"})

    def continue_generation(self) -> None:
        self.call("/continue_generation", {})

    def flush_cache(self) -> None:
        self.call("/flush_cache", {})

    def begin_weight_update(self) -> None:
        self.call("/begin_weight_update", {})

    def update_weights_from_tensors(self, named_tensors, *, flush: bool = True) -> None:
        raise NotImplementedError(
            "an engine server takes weights by the broadcast group or from disk (miles.rollout.engine.weight_transport)"
        )

    def end_weight_update(self, version: int) -> None:
        # SGLang's order: the version first (without aborting anything), then close the session.
        self.call("/update_weight_version", {"new_version": str(version), "abort_all_requests": False})
        self.call("/end_weight_update", {})

    def release_memory_occupation(self, tags: list[str] | None = None) -> None:
        self.call("/release_memory_occupation", {} if tags is None else {"tags": list(tags)})

    def resume_memory_occupation(self, tags: list[str] | None = None) -> None:
        self.call("/resume_memory_occupation", {} if tags is None else {"tags": list(tags)})

    def load(self, timeout: float | None = None) -> int:
        """Requests running or waiting inside the engine, summed over its DP ranks (SGLang's `/v1/loads`)."""
        data = self.call("/v1/loads?include=core", method="GET", timeout=timeout)
        loads = data.get("loads", []) if isinstance(data, dict) else []
        return sum(int(d.get("num_running_reqs", 0)) + int(d.get("num_waiting_reqs", 0)) for d in loads)

    def health(self) -> dict[str, Any]:
        info = self.call("/model_info", method="GET")
        return {"ok": True, "weight_version": info.get("weight_version"), "paused": None, "url": self.url}

    def health_generate(self, timeout: float) -> None:
        """Raises unless the engine generates one token within `timeout` seconds."""
        self.call("/health_generate", method="GET", timeout=timeout)

    def get_weights_checksum(self) -> str:
        data = self.call("/weights_checker", {"action": "checksum"})
        if "checksum" not in data:  # SGLang answers its own per-rank checksums of its own parameter layout
            from miles.errors import UserError

            raise UserError(
                f"--check-weight-update-equal compares sha256 sums of Hugging Face-named weights, and the server at "
                f"{self.url} answers /weights_checker with its own checksum format; drop --check-weight-update-equal.",
                option="--check-weight-update-equal",
            )
        return data["checksum"]
