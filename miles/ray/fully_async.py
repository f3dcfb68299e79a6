"""--fully-async: a worker that keeps the engines generating prompt groups into a bounded buffer while the
trainer trains, and the per-step take from that buffer with the staleness bound.

The worker runs its own event loop on a thread of the rollout manager's actor. It keeps
--rollout-batch-size groups in flight; a finished group is scored, passed through the dynamic-sampling
filter and put in the buffer (at most 2 × --rollout-batch-size groups; the worker waits while it is full).
A group with an aborted sample (a weight update aborts what is in flight) goes back to the prompt source
and is generated again from its prompt.

`take(rollout_id)` returns --rollout-batch-size groups, oldest first. The trainer's weights at rollout r are
version r (the weights after r updates); a group whose oldest token came from version v lags r − v updates.
A group lagging more than --max-weight-staleness goes back to the prompt source (re-generated, never
trained on). Every group is either trained once, in the buffer, in flight, or back in the prompt source;
`state_dict` puts the buffered and in-flight ones back first, so a checkpoint re-generates them on resume
and no prompt is lost or trained twice.
"""

from __future__ import annotations

import asyncio
import collections
import threading
import time
from typing import Any, Callable

from miles.errors import StepFailed
from miles.rollout.filters import apply_group_filter
from miles.sample import Sample, SampleStatus

BUFFER_FACTOR = 2  # upstream's default --async-data-buffer-capacity-factor
TAKE_TIMEOUT_S = 1800.0  # one step's worth of generation on a loaded CPU


def group_lag(group: list[Sample], trainer_version: int) -> int | None:
    """Updates the group's oldest token lags behind `trainer_version`; None when no sample has a version."""
    versions = [v for v in (s.oldest_weight_version() for s in group) if v is not None]
    return None if not versions else trainer_version - min(versions)


class AsyncRolloutWorker:
    """`manager`: the RolloutManager whose engine, prompt source, filter and rewards it uses; `as_fresh`:
    how a group goes back to the prompt source (its prompt and numbering, no response)."""

    def __init__(self, manager: Any, as_fresh: Callable[[Sample], Sample]):
        self.m = manager
        self.as_fresh = as_fresh
        cfg = manager.cfg
        self.batch = cfg.data.rollout_batch_size
        self.capacity = BUFFER_FACTOR * self.batch
        self.bound = cfg.asynchrony.max_weight_staleness
        self._cond = threading.Condition()
        self._buffer: collections.deque[tuple[int, list[Sample], list[Sample]]] = collections.deque()  # (draw, prompts, samples)
        self._in_flight: dict[int, list[Sample]] = {}
        self._draws = 0
        self._error: BaseException | None = None
        self._stop = False
        self._counts: dict[str, float] = collections.defaultdict(float)
        self._tokens = 0
        self._thread = threading.Thread(target=self._run, name="miles-fully-async-rollout", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ worker thread
    def _run(self) -> None:
        try:
            asyncio.run(self._loop())
        except BaseException as e:  # noqa: BLE001 - reported by the next take()
            with self._cond:
                self._error = e
                self._cond.notify_all()

    def _draw(self) -> list[tuple[int, list[Sample]]]:
        """Groups to keep --rollout-batch-size in flight (none while the buffer is full), numbered and
        registered as in flight under the same lock as the draw, so `state_dict` never misses one."""
        with self._cond:
            room = self.capacity - len(self._buffer) - len(self._in_flight)
            want = min(self.batch - len(self._in_flight), room)
            if want <= 0:
                return []
            out = []
            for g in self.m.data_source.get_samples(want, self.m.cfg.data.n_samples_per_prompt):
                self._draws += 1
                self._in_flight[self._draws] = g
                out.append((self._draws, g))
            return out

    async def _loop(self) -> None:
        from miles.rollout.engine.base import SamplingParams

        params = SamplingParams.from_rollout_config(self.m.cfg.rollout)
        tasks: dict[asyncio.Future, int] = {}
        while not self._stop:
            for draw, g in self._draw():
                # The engine client sends the requests of every task created in this turn together.
                task = self.m._group(g, rollout_id=draw, purpose="async", params=params, rid=f"async-{draw:08d}-")
                tasks[asyncio.ensure_future(task)] = draw
            if not tasks:
                await asyncio.sleep(0.05)  # the buffer is full: the trainer takes from it
                continue
            done, _ = await asyncio.wait(tasks, timeout=0.5, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                draw = tasks.pop(task)
                samples, tokens = task.result()
                self._tokens += tokens
                with self._cond:
                    g = self._in_flight.pop(draw)  # the drawn prompts: what goes back when not trained
                    self._finish(draw, g, samples)
                    self._cond.notify_all()

    def _finish(self, draw: int, g: list[Sample], samples: list[Sample]) -> None:
        """A generated group (`samples`, made of the drawn `g`): to the buffer, back to the prompt source
        (a sample was aborted, e.g. by a weight update), or dropped (the dynamic-sampling filter)."""
        if any(s.status == SampleStatus.ABORTED for s in samples):
            self._counts["rollout/async_aborted_groups_regenerated"] += 1
            self.m.data_source.add_samples([[self.as_fresh(s) for s in g]])
            return
        if self.m.dynamic_filter is not None:
            verdict = apply_group_filter(self.m.dynamic_filter, self.m.cfg.reward, samples)
            if not verdict.keep:
                self._counts[f"rollout/dynamic_filter/drop_{verdict.reason}"] += 1
                return
        self._buffer.append((draw, g, samples))

    # ------------------------------------------------------------------ trainer side
    def take(self, rollout_id: int) -> tuple[list[list[Sample]], dict[str, float], int]:
        """--rollout-batch-size groups within the staleness bound (oldest first), counts, generated tokens."""
        kept: list[tuple[int, list[Sample]]] = []
        deadline = time.monotonic() + TAKE_TIMEOUT_S
        with self._cond:
            while len(kept) < self.batch:
                if self._error is not None:
                    raise StepFailed(f"--fully-async: the rollout worker stopped: {self._error!r}") from self._error
                if not self._buffer:
                    if not self._cond.wait(timeout=max(0.0, deadline - time.monotonic())) and time.monotonic() > deadline:
                        raise StepFailed(
                            f"--fully-async: waited {TAKE_TIMEOUT_S:.0f} s for rollout {rollout_id}'s groups from the engines "
                            f"({len(kept)} of {self.batch} ready, {len(self._in_flight)} in flight)"
                        )
                    continue
                draw, g, samples = self._buffer.popleft()
                lag = group_lag(samples, rollout_id)
                if self.bound is not None and lag is None:  # unbounded data must not pass as fresh
                    raise StepFailed(
                        f"--max-weight-staleness: the generate function gave prompt group {samples[0].group_index} no weight "
                        "version (Sample.weight_versions or weight_version, from the engine's response), so its staleness "
                        "cannot be bounded; record it in the generate function or drop --max-weight-staleness"
                    )
                if self.bound is not None and lag > self.bound:
                    self._counts["rollout/stale_groups_regenerated"] += 1
                    self.m.data_source.add_samples([[self.as_fresh(s) for s in g]])
                    continue
                kept.append((draw, samples))
            self._cond.notify_all()  # room in the buffer: the worker draws again
            counts, self._counts = dict(self._counts), collections.defaultdict(float)
            tokens, self._tokens = self._tokens, 0
        counts["rollout/async_buffer_groups"] = float(len(self._buffer))
        return [g for _, g in sorted(kept, key=lambda x: x[0])], counts, tokens

    def state_dict(self) -> dict[str, Any]:
        """The prompt source's position with every buffered and in-flight group first in line, as fresh
        prompts: a resume re-generates them (no weights of the interrupted run are kept to continue them)."""
        with self._cond:
            state = self.m.data_source.state_dict()
            waiting = sorted([*((d, g) for d, g, _ in self._buffer), *self._in_flight.items()], key=lambda x: x[0])
            state["buffer"] = [[self.as_fresh(s).to_dict() for s in g] for _, g in waiting] + state["buffer"]
        return state

    def stop(self) -> None:
        self._stop = True
        self._thread.join(timeout=30)
