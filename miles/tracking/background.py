"""`BackgroundSink`: a sink's writes on a thread of their own, so a slow store does not slow the loop.

MLflow's `log_batch` to its sqlite store takes 5-15 ms a call (a transaction and a commit), twice a
step: 6% of a default step on the loop's critical path. Wrapped here, `log` only queues the record; one
writer thread sends whatever has queued up since its last write in one call (`log_many`, when the
sink has it), in the order logged. `close(status)` waits until everything queued is written (up to
`flush_timeout_s`, then says how many records it dropped) before the sink closes, so a finished run's
store holds every step. A write that fails is handed to `on_error(step)` (the `Tracker` counts it and
logs the first traceback) and the thread goes on.

The sink can also be opened on that thread: `BackgroundSink.opening(name, open_sink)` returns at once
and the thread first calls `open_sink()` (MLflow's imports, its store and run, ~770 params: seconds of
CPU the driver used to spend before the first step, while the actors still set up on the same cores),
then writes what was logged meanwhile. An error while opening is kept and raised, unchanged, by
`raise_if_open_failed()` (the `Tracker` calls it on every `log`, so a bad `--mlflow-run-id` still ends
the run with its own message) and is `open_error`; attributes of the wrapped sink wait for the open.

    sink = BackgroundSink(MlflowSink(...), on_error=lambda step: ...)
    sink = BackgroundSink.opening("mlflow", lambda: MlflowSink(...), on_error=...)   # or opened here
    sink.log(metrics, step)      # returns at once
    sink.close("FINISHED")       # flushes, then closes the MLflow run
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from typing import Any

log = logging.getLogger(__name__)


class BackgroundSink:
    def __init__(self, sink: Any, *, on_error: Callable[[Any, int], None], flush_timeout_s: float = 120.0,
                 _open: Callable[[], Any] | None = None, _name: str | None = None):
        self._sink = sink
        self._open = _open
        self._open_error: BaseException | None = None
        self._opened = threading.Event()
        if _open is None:
            self._opened.set()
        self.name = _name if _open is not None else sink.name
        self._on_error = on_error
        self._flush_timeout_s = flush_timeout_s
        self._queue: list[tuple[dict[str, float], int]] = []
        self._cond = threading.Condition()
        self._closing = False
        self._busy = False
        self._thread = threading.Thread(target=self._run, name=f"miles-{self.name}-writer", daemon=True)
        self._thread.start()

    @classmethod
    def opening(cls, name: str, open_sink: Callable[[], Any], *, on_error: Callable[[Any, int], None],
                flush_timeout_s: float = 120.0) -> BackgroundSink:
        """A sink that `open_sink()` builds on the writer thread, before its first write."""
        return cls(None, on_error=on_error, flush_timeout_s=flush_timeout_s, _open=open_sink, _name=name)

    @property
    def sink(self) -> Any:
        """The wrapped sink, once open (waits for it; raises what opening it raised)."""
        self._wait_opened()
        self.raise_if_open_failed()
        return self._sink

    def raise_if_open_failed(self) -> None:
        """Raise what opening the sink raised, if it has failed by now (does not wait for the open)."""
        if self._open_error is not None:
            raise self._open_error

    @property
    def open_error(self) -> BaseException | None:
        """What opening the sink raised (None: it opened, or it was given open); waits for the open."""
        self._wait_opened()
        return self._open_error

    def _wait_opened(self) -> None:
        if not self._opened.wait(self._flush_timeout_s):
            raise TimeoutError(f"the {self.name} sink did not open within {self._flush_timeout_s:.0f} s (its store or run)")

    def __getattr__(self, name: str) -> Any:  # run_id, tracking_uri, ... of the wrapped sink
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.sink, name)

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        with self._cond:
            self._queue.append((dict(metrics), step))
            self._cond.notify()

    def _run(self) -> None:
        if self._open is not None:
            try:
                self._sink = self._open()
            except BaseException as e:  # noqa: BLE001 - kept for the caller's thread (raise_if_open_failed)
                self._open_error = e
            finally:
                self._open = None
                self._opened.set()
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue or self._closing)
                if not self._queue:
                    return  # closing and nothing left
                batch, self._queue = self._queue, []
                self._busy = True
            try:
                self._write(batch)
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def _write(self, batch: list[tuple[dict[str, float], int]]) -> None:
        if self._open_error is not None:
            return  # no sink to write to: the caller gets the open's error instead (raise_if_open_failed)
        many = getattr(self._sink, "log_many", None)
        if many is not None:
            try:
                many(batch)
                return
            except Exception:  # noqa: BLE001 - retried record by record, so one bad record is counted alone
                pass
        for metrics, step in batch:
            try:
                self._sink.log(metrics, step)
            except Exception:  # noqa: BLE001 - reported through on_error, the run goes on
                self._on_error(self, step)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued record is written; False if `timeout` (default `flush_timeout_s`) ran out."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._queue and not self._busy,
                                       self._flush_timeout_s if timeout is None else timeout)

    def close(self, status: str) -> None:
        if not self.flush():
            with self._cond:
                dropped, self._queue = len(self._queue), []
            log.warning("metrics sink %s: %d record(s) not written within %.0f s of the run's end; dropped",
                        self.name, dropped, self._flush_timeout_s)
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._thread.join(timeout=5)
        if self.open_error is None:  # one that never opened has nothing to close (the Tracker reports why)
            self._sink.close(status)
