"""`remote_rm` reward: POST the sample to a reward server (`--rm-url`) and use its answer.

Request: HTTP POST, JSON body `{"prompt": ..., "response": ..., "label": ...}` (prompt as the sample
holds it: text or chat messages). Answer: a JSON number, or a JSON object (pick the entry to train on
with `--reward-key`). Each attempt waits at most `--rm-timeout` seconds; a timeout, a connection
error or an HTTP 5xx/429 answer is retried up to `--rm-max-retries` times with doubling back-off
(0.5 s, 1 s, 2 s, ... capped at 8 s). Any other HTTP error (4xx: the server rejects the request) and
an answer that is not a number or object fail at once. Giving up raises `RemoteRewardError`, an
internal error that names the URL, the attempts and the last failure.

Uses only the standard library (urllib in a worker thread), so the event loop keeps running other
samples' requests while one waits.
"""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request
from typing import Any

from miles.config.reward import RewardConfig
from miles.errors import UserError
from miles.rollout.rm_hub.types import RewardInput

_FIRST_BACKOFF_S = 0.5
_MAX_BACKOFF_S = 8.0
_RETRIED_STATUS = frozenset({429, 500, 502, 503, 504})


class RemoteRewardError(RuntimeError):
    """The reward server did not give a usable reward."""


class _Retryable(Exception):
    pass


def _post_once(url: str, body: bytes, timeout_s: float) -> Any:
    request = urllib.request.Request(url, data=body, method="POST", headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as answer:
            raw = answer.read()
    except urllib.error.HTTPError as e:
        reason = f"HTTP {e.code} {e.reason}"
        if e.code in _RETRIED_STATUS:
            raise _Retryable(reason) from None
        raise RemoteRewardError(f"reward server {url} rejected the request: {reason}") from None
    except (urllib.error.URLError, TimeoutError, ConnectionError, OSError) as e:
        reason = getattr(e, "reason", e)
        if isinstance(reason, TimeoutError) or isinstance(e, TimeoutError):
            raise _Retryable(f"no answer within {timeout_s} s (--rm-timeout)") from None
        raise _Retryable(f"connection failed: {reason}") from None
    try:
        value = json.loads(raw)
    except json.JSONDecodeError:
        raise RemoteRewardError(f"reward server {url} answered non-JSON {raw[:200]!r}") from None
    if isinstance(value, bool) or not isinstance(value, (int, float, dict)):
        raise RemoteRewardError(f"reward server {url} answered {value!r}; expected a number or a JSON object")
    return float(value) if not isinstance(value, dict) else value


async def post_reward(
    url: str,
    payload: dict[str, Any],
    *,
    timeout_s: float,
    max_retries: int,
    first_backoff_s: float = _FIRST_BACKOFF_S,
) -> float | dict[str, Any]:
    """POST `payload` to `url`, retrying transient failures; see the module docstring."""
    body = json.dumps(payload).encode("utf-8")
    attempts = max_retries + 1
    last_failure = ""
    for attempt in range(attempts):
        if attempt:
            await asyncio.sleep(min(first_backoff_s * 2 ** (attempt - 1), _MAX_BACKOFF_S))
        try:
            return await asyncio.to_thread(_post_once, url, body, timeout_s)
        except _Retryable as e:
            last_failure = str(e)
    raise RemoteRewardError(
        f"reward server {url} failed {attempts} time(s) (--rm-max-retries {max_retries}); last failure: "
        f"{last_failure}. Check that the server is up and --rm-url is right."
    )


async def remote_reward(cfg: RewardConfig, inp: RewardInput) -> float | dict[str, Any]:
    if not cfg.rm_url:
        # check() rejects this for --rm-type; a sample's metadata["rm_type"] can still ask for it.
        raise UserError(f"reward type {inp.rm_type!r} needs --rm-url, the address of the reward server.", option="--rm-url")
    payload = {"prompt": inp.sample.prompt, "response": inp.response, "label": inp.label}
    return await post_reward(cfg.rm_url, payload, timeout_s=cfg.rm_timeout, max_retries=cfg.rm_max_retries)
