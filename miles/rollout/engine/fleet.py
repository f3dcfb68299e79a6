"""`EngineFleet`: N engine servers (one Ray actor each) behind the real sglang-router.

The servers are built-in engine servers (`EngineServerActor`, --rollout-backend builtin with
--rollout-num-gpus) or SGLang servers (miles.ray.sglang_server_actor), started by an `EngineLauncher`
(Ray actors: miles.ray.engine_launcher, chosen by miles.ray.engine_factory); everything below is the
same for both, and nothing here imports Ray.

The fleet is itself a `RolloutEngine`, so the rollout manager drives one engine or many the same way:
`submit` sends `/generate` to the router; pause, abort, flush, memory and the weight-update session
fan out to every engine directly (the router forwards only `/generate`).

Health and fault tolerance. A monitor thread calls every serving engine's `/health_generate` every
`--rollout-health-check-interval` seconds (after `--rollout-health-check-first-wait`), with
`--rollout-health-check-timeout`; it stands down during weight updates, when engines are paused on
purpose, and while any engine memory is released (`release_memory_occupation` by tag; a probe would
generate on freed memory), until every released tag is resumed. Before a release the fleet drains:
it aborts every request and repeats the abort until every engine reports no running or waiting
request (`/v1/loads`), because requests still on their way through the router arrive after the
first abort, and SGLang refuses a release while it is not idle. An engine that fails the probe (or
whose process is gone):

- with `--use-fault-tolerance`: is removed from the router, killed, and restarted (a new actor in
  the same placement bundle, a new port). The new engine does not serve until it has the current
  weights: it joins the next weight update and only then is added to the router. Requests that were
  in flight on the dead engine fail at the router and are re-queued by `submit`: before a failed
  request is sent again, every serving engine is probed (`/health`; a killed process refuses at
  once) and the dead one is taken out of the router, so the request goes to a live engine and is
  sent again exactly once. `restarts` counts restarts (`rollout/engine_restarts`), `requeued` the
  requests sent again (`rollout/requeued_requests`). The router's own retries are off (see
  `router.py`): re-sending blind, it could pick the dead engine again and the count would be lost.
- without it: the run stops with one sentence naming the engine (`RunStopped`), never a hang.

    fleet = EngineFleet(launcher, num_engines=2, policy="round_robin", ft=FaultToleranceConfig())
    fleet.submit(GenerateRequest([1, 2, 3])).result()
    fleet.weight_targets()   # (index, URL) of the engines the trainer pushes weights to

`max_in_flight` (--sglang-server-concurrency × engines for SGLang) caps the requests sent at once;
the rest wait in the fleet, in submission order.
"""

from __future__ import annotations

import abc
import collections
import concurrent.futures
import dataclasses
import os
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from miles.errors import RunStopped
from miles.rollout.engine.base import GenerateRequest, GenerateResponse, RolloutEngine
from miles.rollout.engine.http_client import EngineHTTPError, HttpEngine

ENGINE_START_TIMEOUT_S = 600.0
# A request that failed while every engine answered its probe (the router had no engine for a moment)
# is sent again after this pause, until this deadline.
REQUEUE_DELAY_S = 0.5
REQUEUE_DEADLINE_S = 600.0
# How long the probe of the engines after a failed request waits for each engine's /health.
PROBE_TIMEOUT_S = 10.0
# Before a memory release: abort, then look at the engines' load again after this pause, until idle
# or the deadline.
DRAIN_POLL_S = 0.5
DRAIN_TIMEOUT_S = 120.0


class EngineServerActor:
    """One `BuiltinEngine` served over HTTP on 127.0.0.1 (a free port), in the process hosting it (a Ray
    actor, by miles.ray.engine_launcher)."""

    def __init__(
        self, hf_dir: str, *, max_batch_size: int, seed: int, device: str, set_threads: Any = None, dtype: str = "float32"
    ):
        import torch

        from miles.rollout.engine.builtin import BuiltinEngine
        from miles.rollout.engine.server import EngineServer

        if set_threads is None:  # no run's layout (a fleet built by hand): one thread
            torch.set_num_threads(1)
        else:  # the launcher's thread policy (miles.ray.threads): this server's share of its node's cores
            set_threads()
        self.server = EngineServer(BuiltinEngine(hf_dir, device=device, dtype=dtype, max_batch_size=max_batch_size, seed=seed))
        self.server.start()

    def url(self) -> str:
        return self.server.url

    def pid(self) -> int:
        return os.getpid()

    def stop(self) -> None:
        self.server.stop()


@dataclasses.dataclass
class _Slot:
    index: int
    actor: Any = None
    url: str | None = None
    pid: int | None = None
    client: HttpEngine | None = None
    state: str = "starting"  # starting -> new (alive, no current weights) -> serving -> dead

    def name(self) -> str:
        return f"rollout engine {self.index} ({self.url}, pid {self.pid})"


class EngineLauncher(abc.ABC):
    """Starts and stops the fleet's engine server processes; the fleet never asks how (Ray actors in
    placement bundles: miles.ray.engine_launcher; anything else that serves the same HTTP API)."""

    @abc.abstractmethod
    def spawn(self, index: int, seed: int) -> Any:
        """Start engine `index` (again, after a death) with `seed`; returns its handle without waiting."""

    @abc.abstractmethod
    def started(self, handle: Any, timeout_s: float) -> tuple[str, int]:
        """(URL, pid) of a spawned engine once it serves; TimeoutError after `timeout_s`."""

    @abc.abstractmethod
    def kill(self, handle: Any, timeout_s: float = 30.0) -> None:
        """Stop the engine's server (its whole process group), then whatever hosted it."""

    def kill_all(self, handles: list[Any], timeout_s: float = 30.0) -> None:
        for h in handles:
            self.kill(h, timeout_s)


class EngineFleet(RolloutEngine):
    def __init__(
        self,
        launcher: EngineLauncher,
        *,
        num_engines: int,
        policy: str,
        ft,
        seed: int = 0,
        log_dir: str | Path | None = None,
        router_argv_for=None,
        max_in_flight: int | None = None,
    ):
        """`launcher` starts engine `index`'s server; `router_argv_for(port, prometheus_port, worker_urls)`
        gives the router's argv (default: `Router.launch`'s own)."""
        from miles.rollout.engine.router import Router

        self.launcher, self.num_engines = launcher, num_engines
        self.ft = ft
        self.fault_tolerant = bool(ft.use_fault_tolerance)
        self._seed = seed
        self._max_in_flight = max_in_flight
        self._in_flight = 0
        self._waiting: collections.deque = collections.deque()
        self.slots = [_Slot(i) for i in range(num_engines)]
        self.restarts = 0
        self.requeued = 0
        self.fatal: str | None = None
        self._lock = threading.RLock()
        self._updating = False
        self.released: set[str] = set()  # memory tags released on every engine; the monitor waits while any is
        self._restarting: dict[int, threading.Thread] = {}
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=max(4, 2 * num_engines))
        self._pending: set[Future] = set()
        self._session: list[tuple[_Slot, str]] = []  # (slot, its URL then): the engines of the update in progress
        self._probe_lock = threading.Lock()
        self._probed_at = float("-inf")  # when the last probe after a failed request started
        self._died_at = float("-inf")  # when an engine was last found dead
        self.log_dir = Path(log_dir) if log_dir is not None else None

        for slot, ref in zip(self.slots, [self._spawn(slot) for slot in self.slots]):
            self._await_spawn(slot, ref)
            slot.state = "serving"
        self.router = Router.launch(
            [s.url for s in self.slots], policy=policy, log_dir=log_dir, health_check_interval_s=ft.rollout_health_check_interval,
            argv_for=router_argv_for,
        )
        self._router_client = HttpEngine(self.router.url)
        self._write_state()
        self._stop = threading.Event()
        self._monitor = threading.Thread(target=self._monitor_loop, name="miles-engine-health", daemon=True)
        self._monitor.start()

    # ------------------------------------------------------------------ engines
    def _spawn(self, slot: _Slot):
        # Each engine (and each restart) gets its own seed, as upstream gives SGLang seed + rank.
        slot.actor = self.launcher.spawn(slot.index, self._seed + 1000 * self.restarts + slot.index)
        slot.state = "starting"
        return slot.actor

    def _await_spawn(self, slot: _Slot, handle) -> None:
        try:
            slot.url, slot.pid = self.launcher.started(handle, ENGINE_START_TIMEOUT_S)
        except TimeoutError:
            raise TimeoutError(f"timed out after {ENGINE_START_TIMEOUT_S:.0f} s waiting for rollout engine {slot.index} to start") from None
        slot.client = HttpEngine(slot.url)

    def _write_state(self) -> None:
        """`<run dir>/engines.json`: where each engine is (URL, pid), its state, the router, restarts."""
        if self.log_dir is None:
            return
        import json

        path = self.log_dir / "engines.json"
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.health(), indent=1))
        tmp.replace(path)

    def _serving(self) -> list[_Slot]:
        return [s for s in self.slots if s.state == "serving"]

    def _engine_failed(self, slot: _Slot, why: str) -> None:
        with self._lock:
            if slot.state != "serving":
                return
            slot.state = "dead"
            self._write_state()
            message = f"{slot.name()} stopped answering: {why}"
            if not self.fault_tolerant:
                self.fatal = (
                    f"{message}; the run stops (add --use-fault-tolerance to restart dead engines, "
                    "and rerun with --load to resume from the last checkpoint)."
                )
                self._died_at = time.monotonic()
                for f in list(self._pending):
                    if not f.done():
                        f.set_exception(RunStopped(self.fatal))
                return
            self.restarts += 1
            # Out of the router before anyone learns it is dead (under the lock, which _probe_engines
            # takes too), so a request re-queued because of this death cannot be routed to it again.
            try:
                self.router.remove_worker(slot.url)
            except Exception:  # noqa: BLE001 - a router that cannot reach the worker has dropped it already
                pass
            self._died_at = time.monotonic()
        print(f"[miles] {message}; restarting it (restart {self.restarts})", flush=True)
        self._kill(slot)  # out of the router already (above, under the lock)

        def restart() -> None:
            ref = self._spawn(slot)
            try:
                self._await_spawn(slot, ref)
                slot.state = "new"  # alive; serves once the next weight update gave it the current weights
                self._write_state()
            except Exception as e:  # noqa: BLE001
                with self._lock:
                    self.fatal = f"{slot.name()} could not be restarted: {e}"

        t = threading.Thread(target=restart, name=f"miles-engine-restart-{slot.index}", daemon=True)
        self._restarting[slot.index] = t
        t.start()

    def _kill(self, slot: _Slot, timeout_s: float = 30.0) -> None:
        """Stop the engine's server (its whole process group for SGLang), then its host."""
        self.launcher.kill(slot.actor, timeout_s)

    def _monitor_loop(self) -> None:
        ft = self.ft
        if self._stop.wait(ft.rollout_health_check_first_wait):
            return
        while not self._stop.wait(ft.rollout_health_check_interval):
            if self._standing_down():
                continue
            for slot in self._serving():
                if self._standing_down() or self._stop.is_set():
                    break
                try:
                    slot.client.health_generate(timeout=ft.rollout_health_check_timeout)
                except Exception as e:  # noqa: BLE001
                    if self._standing_down():
                        break
                    self._engine_failed(slot, str(e))

    def _standing_down(self) -> bool:
        """Paused on purpose (a weight update) or memory released: /health_generate must not run then."""
        return self._updating or bool(self.released)

    # ------------------------------------------------------------------ generation
    def _acquire(self, request: GenerateRequest, start) -> None:
        """Run `start` now, or once fewer than `max_in_flight` requests are out."""
        with self._lock:
            if self._max_in_flight is not None and self._in_flight >= self._max_in_flight:
                self._waiting.append((request, start))
                return
            self._in_flight += 1
        start()

    def _release(self, _: Future) -> None:
        with self._lock:
            start = self._waiting.popleft()[1] if self._waiting else None
            if start is None:
                self._in_flight -= 1
        if start is not None:
            start()  # takes over the finished request's place

    def _abort_waiting(self, rid: str, abort_all: bool) -> list:
        """Take the matching requests that were never sent out of the queue (they answer "abort")."""
        with self._lock:
            hit = [w for w in self._waiting if abort_all or (w[0].rid or "").startswith(rid)]
            for w in hit:
                self._waiting.remove(w)
        return hit

    def submit(self, request: GenerateRequest) -> "Future[GenerateResponse]":
        outer: Future = Future()
        outer.set_running_or_notify_cancel()
        self._pending.add(outer)
        outer.add_done_callback(self._pending.discard)
        deadline = time.monotonic() + REQUEUE_DEADLINE_S

        def attempt() -> None:
            if self.fatal:
                outer.set_exception(RunStopped(self.fatal))
                return
            self._router_client.submit(request).add_done_callback(done)

        def done(f: Future) -> None:
            if outer.done():
                return
            exc = f.exception()
            if exc is None:
                outer.set_result(f.result())
            elif self.fatal:
                outer.set_exception(RunStopped(self.fatal))
            elif isinstance(exc, EngineHTTPError) and (exc.status is None or exc.status >= 500):
                if time.monotonic() >= deadline:
                    outer.set_exception(EngineHTTPError(
                        f"request {request.rid or ''} still failed after being re-sent for {REQUEUE_DEADLINE_S:.0f} s "
                        f"(no rollout engine answered it): {exc}", status=exc.status))  # fmt: skip
                    return
                # The engine died under it (or the router had no engine for a moment): find the dead
                # engine, then send it again. Not on this thread: it is the HTTP client's event loop.
                self._pool.submit(requeue, time.monotonic())
            else:
                outer.set_exception(exc)

        def requeue(failed_at: float) -> None:
            found_dead = self._probe_engines(failed_at)
            with self._lock:
                self.requeued += 1
            if self.fatal:  # without fault tolerance the probe has just stopped the run
                outer.set_exception(RunStopped(self.fatal))
            elif found_dead:
                attempt()
            else:
                threading.Timer(REQUEUE_DELAY_S, attempt).start()

        def first() -> None:
            outer.add_done_callback(self._release)
            attempt()

        first.outer = outer  # for _abort_waiting
        self._acquire(request, first)
        return outer

    def _probe_engines(self, failed_at: float) -> bool:
        """After a request failed at `failed_at`: probe every serving engine's `/health` and hand the
        ones that do not answer to `_engine_failed` (out of the router; restart or stop). One probe
        serves every request that failed before it started. True when an engine was found dead since
        the request failed (by this probe or the monitor), so sending it again reaches a live one."""
        with self._probe_lock:
            if self._probed_at < failed_at:
                self._probed_at = time.monotonic()
                for slot in self._serving():
                    try:
                        slot.client.call("/health", method="GET", timeout=min(PROBE_TIMEOUT_S, self.ft.rollout_health_check_timeout))
                    except EngineHTTPError as e:
                        self._engine_failed(slot, str(e))
        with self._lock:  # a death being handled elsewhere (the monitor) finishes its router removal first
            return self._died_at >= failed_at or self.fatal is not None

    def _each(self, fn_name: str, *args, slots: list[_Slot] | None = None) -> None:
        slots = self._serving() if slots is None else slots
        futures = {self._pool.submit(getattr(s.client, fn_name), *args): s for s in slots}
        for f in concurrent.futures.as_completed(futures):
            slot = futures[f]
            try:
                f.result()
            except EngineHTTPError as e:
                if slot.state == "new":  # a restarted engine that fails before serving is dead like any other
                    slot.state = "serving"
                self._engine_failed(slot, str(e))
        if self.fatal:
            raise RunStopped(self.fatal)

    def abort_request(self, rid: str = "", abort_all: bool = False) -> None:
        for request, start in self._abort_waiting(rid, abort_all):
            start.outer.set_result(
                GenerateResponse(output_ids=[], text="", finish_type="abort", prompt_tokens=len(request.input_ids), rid=request.rid)
            )
        self._each("abort_request", rid, abort_all)

    def pause_generation(self) -> None:
        self._each("pause_generation")

    def continue_generation(self) -> None:
        self._each("continue_generation")

    def flush_cache(self) -> None:
        self._each("flush_cache")

    def drain(self, timeout_s: float = DRAIN_TIMEOUT_S) -> None:
        """Abort every request, again and again, until every serving engine reports no load."""
        deadline = time.monotonic() + timeout_s
        while True:
            self.abort_request(abort_all=True)
            loads = {}
            for slot in self._serving():
                try:
                    loads[slot.url] = slot.client.load(timeout=PROBE_TIMEOUT_S)
                except EngineHTTPError as e:
                    self._engine_failed(slot, str(e))
            if self.fatal:
                raise RunStopped(self.fatal)
            busy = {u: n for u, n in loads.items() if n}
            if not busy:
                return
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"timed out after {timeout_s:.0f} s waiting for the rollout engines to finish their requests before "
                    f"releasing memory (still running or waiting: {busy})"
                )
            time.sleep(DRAIN_POLL_S)

    def release_memory_occupation(self, tags: list[str] | None = None) -> None:
        """Drain, then release `tags` (None: all) on every engine; the monitor stands down until resumed."""
        from miles.rollout.engine.base import memory_tags

        tags = [t for t in memory_tags(tags) if t not in self.released]
        if not tags:
            return
        self.drain()
        self.released.update(tags)  # before the call: a probe must not reach an engine mid-release
        self._each("release_memory_occupation", tags)

    def resume_memory_occupation(self, tags: list[str] | None = None) -> None:
        """Resume the released ones of `tags` (None: all; SGLang fails on a tag not released); the monitor
        probes again once nothing is released."""
        from miles.rollout.engine.base import memory_tags

        tags = [t for t in memory_tags(tags) if t in self.released]
        if not tags:
            return
        self._each("resume_memory_occupation", tags)
        self.released.difference_update(tags)

    # ------------------------------------------------------------------ weights
    def _in_session(self) -> list[_Slot]:
        """The engines of the update in progress (those that opened it) that are still alive; a slot
        restarted meanwhile has a new URL and is not one of them."""
        return [s for s, url in self._session if s.url == url and s.state in ("serving", "new")]

    def weight_targets(self) -> list[tuple[int, str]]:
        """(index, URL) of the engines the update in progress goes to: the serving ones and the
        restarted ones (state "new") that were ready when it began. The index places the engine's GPUs."""
        return [(s.index, s.url) for s in self._in_session()]

    def begin_weight_update(self) -> None:
        """Upstream's order: (restarted engines ready) → pause → flush → begin, on every engine.
        An engine restarted while this update runs is not part of it: it waits for the next one."""
        for index, t in list(self._restarting.items()):
            t.join(ENGINE_START_TIMEOUT_S)
            self._restarting.pop(index, None)
        if self.fatal:
            raise RunStopped(self.fatal)
        self._updating = True
        self._session = [(s, s.url) for s in self.slots if s.state in ("serving", "new")]
        self._each("pause_generation", slots=self._in_session())
        self._each("flush_cache", slots=self._in_session())
        self._each("begin_weight_update", slots=self._in_session())

    def update_weights_from_tensors(self, named_tensors, *, flush: bool = True) -> None:
        raise NotImplementedError("engine servers take weights from the trainer's source rank (weight_transport)")

    def end_weight_update(self, version: int) -> None:
        """Version + end + continue on every engine of this update; restarted engines that took part
        now have the current weights and join the router."""
        self._each("end_weight_update", version, slots=self._in_session())
        self._each("continue_generation", slots=self._in_session())
        for slot in self._in_session():
            if slot.state == "new":
                self.router.add_worker(slot.url)
                slot.state = "serving"
                self._write_state()
        self._updating = False

    def recover(self) -> bool:
        """After a failed weight update: find dead engines (stop, or restart them with fault tolerance)
        and close the update session the survivors are still in, so the update can be run again (True)."""
        for slot in [s for s in self.slots if s.state in ("serving", "new")]:
            try:
                slot.client.call("/health", method="GET", timeout=self.ft.rollout_health_check_timeout)
            except EngineHTTPError as e:
                if slot.state == "new":
                    slot.state = "serving"  # so that _engine_failed handles it like any other
                self._engine_failed(slot, str(e))
        if self.fatal:
            raise RunStopped(self.fatal)
        for index, t in list(self._restarting.items()):
            t.join(ENGINE_START_TIMEOUT_S)
            self._restarting.pop(index, None)
        for slot in [s for s in self.slots if s.state in ("serving", "new")]:
            try:
                slot.client.call("/end_weight_update", {})
            except EngineHTTPError:
                pass  # no session open
        self._updating = False
        if self.fatal:
            raise RunStopped(self.fatal)
        return True

    def health(self) -> dict[str, Any]:
        return {
            "ok": self.fatal is None and bool(self._serving()),
            "engines": [{"index": s.index, "url": s.url, "pid": s.pid, "state": s.state} for s in self.slots],
            "restarts": self.restarts,
            "requeued": self.requeued,
            "router": getattr(getattr(self, "router", None), "url", None),
            "weight_version": None,
            "paused": None,
        }

    def get_weights_checksum(self) -> str:
        sums = {s.client.get_weights_checksum() for s in self._serving()}
        if len(sums) != 1:
            return f"engines disagree: {sorted(sums)}"
        return sums.pop()

    def shutdown(self) -> None:
        self._stop.set()
        self.router.stop()
        self.launcher.kill_all([s.actor for s in self.slots if s.actor is not None])
