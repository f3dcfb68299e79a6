"""`BackgroundSink`: a sink's writes on a thread of their own, so a slow store does not slow the loop.

MLflow's `log_batch` to its sqlite store takes 5-15 ms a call (a transaction and a commit), twice a
step: 6% of a default step on the loop's critical path. Wrapped here, `log` only queues the record; one
writer thread sends whatever has queued up since its last write in one call (`log_many`, when the
sink has it), in the order logged. `close(status)` waits until everything queued is written (up to
`flush_timeout_s`, then says how many records it dropped) before the sink closes, so a finished run's
store holds every step. A write that fails is handed to `on_error(step)` (the `Tracker` counts it and
logs the first traceback) and the thread goes on.

    sink = BackgroundSink(MlflowSink(...), on_error=lambda step: ...)
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
    def __init__(self, sink: Any, *, on_error: Callable[[Any, int], None], flush_timeout_s: float = 120.0):
        self.sink = sink
        self.name = sink.name
        self._on_error = on_error
        self._flush_timeout_s = flush_timeout_s
        self._queue: list[tuple[dict[str, float], int]] = []
        self._cond = threading.Condition()
        self._closing = False
        self._busy = False
        self._thread = threading.Thread(target=self._run, name=f"miles-{sink.name}-writer", daemon=True)
        self._thread.start()

    def __getattr__(self, name: str) -> Any:  # run_id, tracking_uri, ... of the wrapped sink
        return getattr(self.sink, name)

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        with self._cond:
            self._queue.append((dict(metrics), step))
            self._cond.notify()

    def _run(self) -> None:
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
        many = getattr(self.sink, "log_many", None)
        if many is not None:
            try:
                many(batch)
                return
            except Exception:  # noqa: BLE001 - retried record by record, so one bad record is counted alone
                pass
        for metrics, step in batch:
            try:
                self.sink.log(metrics, step)
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
        self.sink.close(status)
