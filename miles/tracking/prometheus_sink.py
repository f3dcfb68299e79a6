"""Prometheus sink (`--use-prometheus`): the latest value of every metric as a gauge over HTTP.

Served by the maintained `prometheus_client` library (its WSGI server in a daemon thread, a private
`CollectorRegistry`, so nothing of the process's default registry leaks out) on
`--prometheus-host`:`--prometheus-port`. The host is 127.0.0.1 by default: a run exposes nothing
to other machines unless the user asks (`--prometheus-host 0.0.0.0` to be scraped from elsewhere).
Each metric key becomes the gauge `miles_prometheus_name(key)` (`rollout/raw_reward` →
`miles_metric_rollout_raw_reward`, see miles/tracking/keys.py) whose help text is the key, with the
label `run_name` = `--prometheus-run-name` or the run id; `miles_step` holds the last logged step.
`close()` stops the server.

Try it: `curl -s 127.0.0.1:9090/metrics` while a run with `--use-prometheus` is going.
"""

from __future__ import annotations

import errno
import logging
import socket
import threading
from collections.abc import Iterator, Mapping

from miles.config.tracking import TrackingConfig
from miles.errors import UserError
from miles.tracking.keys import prometheus_name

log = logging.getLogger(__name__)

STEP_GAUGE = "miles_step"


class _LatestValues:
    """A prometheus_client collector over {gauge name: (metric key, value)}, read at scrape time."""

    def __init__(self, run_name: str):
        self.run_name = run_name
        self.gauges: dict[str, tuple[str, float]] = {}
        self.lock = threading.Lock()

    def collect(self) -> Iterator[object]:
        from prometheus_client.core import GaugeMetricFamily

        with self.lock:
            items = sorted(self.gauges.items())
        for name, (key, value) in items:
            family = GaugeMetricFamily(name, key, labels=["run_name"])
            family.add_metric([self.run_name], value)
            yield family


class PrometheusSink:
    name = "prometheus"

    def __init__(self, cfg: TrackingConfig, *, run_id: str):
        from prometheus_client import CollectorRegistry, start_http_server

        self.run_name = cfg.prometheus_run_name or run_id
        self._values = _LatestValues(self.run_name)
        self._reported: set[str] = set()
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self._values)
        self.host = cfg.prometheus_host
        try:
            self.server, self._thread = start_http_server(cfg.prometheus_port, addr=self.host, registry=self.registry)
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise UserError(
                    f"--prometheus-port {cfg.prometheus_port} is already in use on {self.host}; pick a free port.",
                    option="--prometheus-port",
                ) from None
            if e.errno in (errno.EADDRNOTAVAIL, errno.EAFNOSUPPORT) or isinstance(e, socket.gaierror):
                raise UserError(
                    f"--prometheus-host {self.host} is not an address of this machine ({e.strerror or e}); "
                    "use 127.0.0.1, 0.0.0.0 or one of this host's addresses.",
                    option="--prometheus-host",
                ) from None
            raise
        self.port: int = self.server.server_address[1]

    def page(self) -> str:
        """The exposition text a scrape would get."""
        from prometheus_client import generate_latest

        return generate_latest(self.registry).decode("utf-8")

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        values = self._values
        with values.lock:
            for key, value in metrics.items():
                name = prometheus_name(key)
                owner = values.gauges.get(name, (key, 0.0))[0]
                if owner != key:
                    if key not in self._reported:
                        self._reported.add(key)
                        log.warning("metric %r maps to gauge %s, already used by %r; not exported", key, name, owner)
                    continue
                values.gauges[name] = (key, value)
            values.gauges[STEP_GAUGE] = ("last logged step", float(step))

    def close(self, status: str) -> None:
        self.server.shutdown()  # waits for serve_forever to return (it polls every 0.5 s)
        self.server.server_close()
        self._thread.join(timeout=5.0)
        if self._thread.is_alive():
            raise RuntimeError("the Prometheus server thread did not stop within 5 s of shutdown()")
