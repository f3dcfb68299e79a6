"""Launch and drive the real `sglang-router` (the pinned Rust wheel 0.3.2; it runs on a CPU).

The router takes `/generate` and spreads it over its workers by `--sglang-router-policy`; it forwards
nothing else (pause, abort and weight updates go to each engine directly). Its retries are off: a
request that failed goes back to `EngineFleet`, which re-queues it once the dead engine is out. It
binds 127.0.0.1, and its Prometheus exporter is pinned to 127.0.0.1 on a free port (its default
0.0.0.0:29000 makes a second router on the host panic).

    router = Router.launch(["http://127.0.0.1:31001", "http://127.0.0.1:31002"], policy="round_robin")
    router.url            # POST {router.url}/generate
    router.remove_worker("http://127.0.0.1:31001"); router.add_worker("http://127.0.0.1:31003")
    router.stop()
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from miles.errors import UserError
from miles.utils.net import free_port

START_TIMEOUT_S = 120.0


def _die_with_parent() -> None:
    """Linux: the router gets SIGTERM when the process that launched it dies (a killed Ray actor
    must not leave a router holding its ports)."""
    if sys.platform.startswith("linux"):
        import ctypes
        import signal

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class Router:
    def __init__(self, process: subprocess.Popen, url: str, log_path: Path | None):
        self.process, self.url, self.log_path = process, url, log_path

    @classmethod
    def launch(
        cls,
        worker_urls: list[str],
        *,
        policy: str = "round_robin",
        log_dir: str | Path | None = None,
        timeout_s: float = START_TIMEOUT_S,
        health_check_interval_s: float = 10.0,
        argv_for=None,
    ) -> "Router":
        """`argv_for(port, prometheus_port, worker_urls)`, when given, is the whole router command line (the SGLang
        backend's, from miles.rollout.sglang.launch.router_argv: --sglang-router-command and the
        --sglang-router-* options); else this interpreter's sglang-router with miles' settings."""
        if argv_for is not None:
            port, prom = free_port("127.0.0.1"), free_port("127.0.0.1")
            return cls._start(argv_for(port, prom, list(worker_urls)), port, len(worker_urls), log_dir, timeout_s)
        try:
            import sglang_router  # noqa: F401
        except ImportError:
            raise UserError(
                "--rollout-num-gpus starts engine servers behind sglang-router, which is not installed; "
                "pip install sglang-router==0.3.2 (a CPU wheel, no torch), or drop --rollout-num-gpus.",
                option="--rollout-num-gpus",
            ) from None
        port, prom = free_port("127.0.0.1"), free_port("127.0.0.1")
        argv = [
            sys.executable, "-m", "sglang_router.launch_router",
            "--host", "127.0.0.1", "--port", str(port),
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(prom),
            "--policy", policy,
            "--worker-urls", *worker_urls,
            "--log-level", "warn",
            # Our servers answer /health without generating, so a pause for a weight update does not
            # make the router drop them; dead engines are the health monitor's job (it removes them).
            "--health-check-endpoint", "/health",
            "--health-check-interval-secs", str(int(max(1, health_check_interval_s))),
            "--request-timeout-secs", "14400",
            # A request whose engine died comes back to the fleet, which takes the dead engine out of
            # the router first and then sends it again, once, and counts it (EngineFleet.submit); the
            # router's own retries would re-send blindly, possibly to the same dead engine, unseen.
            "--disable-retries",
        ]
        return cls._start(argv, port, len(worker_urls), log_dir, timeout_s)

    @classmethod
    def _start(cls, argv: list[str], port: int, n_workers: int, log_dir, timeout_s: float) -> "Router":
        log_path = None
        out = subprocess.DEVNULL
        if log_dir is not None:
            log_path = Path(log_dir) / "sglang-router.log"
            log_path.parent.mkdir(parents=True, exist_ok=True)
            out = log_path.open("ab")
        # Its own process group, so stopping it never signals the Ray worker that launched it.
        process = subprocess.Popen(
            argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env={**os.environ}, preexec_fn=_die_with_parent
        )
        router = cls(process, f"http://127.0.0.1:{port}", log_path)
        router.wait_ready(n_workers, timeout_s)
        return router

    def _get(self, path: str, timeout: float = 5.0):
        import requests

        return requests.get(f"{self.url}{path}", timeout=timeout)

    def wait_ready(self, n_workers: int, timeout_s: float) -> None:
        """Wait until the router answers and `n_workers` workers are registered and healthy."""
        deadline = time.monotonic() + timeout_s
        last = "no answer"
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"sglang-router exited with code {self.process.returncode} (log: {self.log_path})")
            try:
                workers = self.workers()
                healthy = [w for w in workers if w.get("is_healthy")]
                if len(healthy) >= n_workers:
                    return
                last = f"{len(healthy)} of {n_workers} workers healthy"
            except Exception as e:  # noqa: BLE001 - not up yet
                last = f"{type(e).__name__}"
            time.sleep(0.2)
        raise TimeoutError(f"timed out after {timeout_s:.0f} s waiting for sglang-router at {self.url} ({last})")

    def workers(self) -> list[dict]:
        r = self._get("/workers")
        r.raise_for_status()
        return r.json().get("workers", [])

    def add_worker(self, url: str, timeout_s: float = START_TIMEOUT_S) -> None:
        import requests

        r = requests.post(f"{self.url}/workers", json={"url": url}, timeout=10)
        if r.status_code not in (200, 202):
            raise RuntimeError(f"sglang-router refused worker {url}: HTTP {r.status_code} {r.text[:200]}")
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if any(w["url"] == url and w.get("is_healthy") for w in self.workers()):
                return
            time.sleep(0.2)
        raise TimeoutError(f"timed out after {timeout_s:.0f} s waiting for sglang-router to register {url}")

    def remove_worker(self, url: str) -> None:
        """DELETE by worker id (0.3.x refuses a URL), looked up in GET /workers."""
        import requests

        for w in self.workers():
            if w["url"] == url:
                requests.delete(f"{self.url}/workers/{w['id']}", timeout=10)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and any(w["url"] == url for w in self.workers()):
            time.sleep(0.1)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)
