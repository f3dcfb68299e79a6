"""Prometheus sink (`--use-prometheus`): the latest value of every metric as a gauge over HTTP.

A stdlib `ThreadingHTTPServer` in a daemon thread serves `GET /metrics` (and `/`) in the Prometheus
text exposition format (version 0.0.4) on `--prometheus-port` (or `$PROMETHEUS_PORT`), bound to
0.0.0.0 by default so a Prometheus server elsewhere can scrape it (`Tracker(prometheus_host=...)`
narrows that). Each metric key becomes the gauge `miles_prometheus_name(key)`
(`rollout/raw_reward` → `miles_metric_rollout_raw_reward`, see miles/tracking/keys.py) with the label
`run_name` = `--prometheus-run-name` or the run id; `miles_step` holds the last logged step.
`finish()` stops the server. No prometheus_client dependency.

Try it: `curl -s localhost:9090/metrics` while a run with `--use-prometheus` is going.
"""

from __future__ import annotations

import errno
import logging
import math
import threading
from collections.abc import Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from miles.config.tracking import TrackingConfig
from miles.errors import UserError
from miles.tracking.keys import prometheus_name

log = logging.getLogger(__name__)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
STEP_GAUGE = "miles_step"


def _label_value(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _help_text(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def format_value(value: float) -> str:
    """A float as the exposition format spells it (`NaN`, `+Inf`, `-Inf`, else Python's repr)."""
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value))


def exposition(gauges: Mapping[str, tuple[str, float]], run_name: str) -> str:
    """The text page for `{gauge name: (metric key, value)}`, one `# HELP`/`# TYPE`/sample triple each."""
    label = f'{{run_name="{_label_value(run_name)}"}}'
    lines = []
    for name in sorted(gauges):
        key, value = gauges[name]
        lines += [f"# HELP {name} {_help_text(key)}", f"# TYPE {name} gauge", f"{name}{label} {format_value(value)}"]
    return "\n".join(lines) + "\n"


class PrometheusSink:
    name = "prometheus"

    def __init__(self, cfg: TrackingConfig, *, run_id: str, host: str = "0.0.0.0"):
        self.run_name = cfg.prometheus_run_name or run_id
        self._gauges: dict[str, tuple[str, float]] = {}
        self._reported: set[str] = set()
        self._lock = threading.Lock()
        sink = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
                if self.path.split("?", 1)[0] not in ("/metrics", "/"):
                    self.send_error(404, "only /metrics is served")
                    return
                body = sink.page().encode("utf-8")
                self.send_response(200)
                self.send_header("Content-Type", CONTENT_TYPE)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: object) -> None:
                pass  # one line per scrape would flood the driver's console

        try:
            self.server = ThreadingHTTPServer((host, cfg.prometheus_port), Handler)
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise UserError(
                    f"--prometheus-port {cfg.prometheus_port} is already in use on {host}; pick a free port.",
                    option="--prometheus-port",
                ) from None
            raise
        self.server.daemon_threads = True
        self.port: int = self.server.server_address[1]
        self._thread = threading.Thread(target=self.server.serve_forever, name="miles-prometheus", daemon=True)
        self._thread.start()

    def page(self) -> str:
        with self._lock:
            return exposition(self._gauges, self.run_name)

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        with self._lock:
            for key, value in metrics.items():
                name = prometheus_name(key)
                owner = self._gauges.get(name, (key, 0.0))[0]
                if owner != key:
                    if key not in self._reported:
                        self._reported.add(key)
                        log.warning(
                            "metric %r maps to gauge %s, already used by %r; not exported", key, name, owner
                        )
                    continue
                self._gauges[name] = (key, value)
            self._gauges[STEP_GAUGE] = ("last logged step", float(step))

    def close(self, status: str) -> None:
        self.server.shutdown()  # waits for serve_forever to return (it polls every 0.5 s)
        self.server.server_close()
        self._thread.join(timeout=5.0)
        if self._thread.is_alive():
            raise RuntimeError("the Prometheus server thread did not stop within 5 s of shutdown()")
