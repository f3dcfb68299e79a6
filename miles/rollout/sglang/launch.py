"""How miles starts SGLang: the server argv of each engine, the router argv, and the health wait.

Pure functions from a resolved `EngineConfig` to command lines, so the engine actors (which run
them with `subprocess.Popen` on their node), `--dry-run` and the tests all see the same processes:

    layout = engine_layout(cfg)                      # how many engines, GPUs each, nodes each spans
    argv = server_argv(cfg, EngineSlot(index=0, host="10.0.0.5", port=30000, nccl_port=30001))
    argv = router_argv(cfg, host="10.0.0.5", port=31000, prometheus_port=31001)
    wait_healthy("http://10.0.0.5:30000", what="SGLang engine 0", timeout_s=600, process=proc)

The server argv is `<server command> --model-path ... --host ... --port ... --tp-size N
--random-seed S --skip-server-warmup [--enable-memory-saver] [multi-node flags]` followed by every
`--sglang-*` option whose value differs from SGLang's default, under SGLang's own flag name. The
server command is `<this interpreter> -m sglang.launch_server` unless `--sglang-server-command`
names another environment's (`/opt/sglang/bin/python -m sglang.launch_server`). Nothing here imports
SGLang, torch or Ray.
"""

from __future__ import annotations

import dataclasses
import json
import shlex
import sys
import time
import urllib.error
import urllib.request
from typing import Any, Protocol

from miles.config.layout import EngineLayout, engine_layout  # noqa: F401  (derived once, in config)
from miles.config.sglang import ROUTER_PREFIX, SERVER_PREFIX, changed_values, router_entry, server_entry
from miles.errors import UserError

HEALTH_POLL_S = 1.0
HEALTH_REQUEST_TIMEOUT_S = 5.0


@dataclasses.dataclass(frozen=True)
class EngineSlot:
    """Where one engine runs: its index, address and ports (and its rank when it spans nodes)."""

    index: int
    host: str
    port: int
    nccl_port: int
    node_rank: int = 0
    dist_init_addr: str | None = None  # "host:port" of the engine's first node when it spans nodes


def server_command(cfg: Any) -> list[str]:
    """The command that starts one SGLang server (before its flags)."""
    given = cfg.sglang_launch.sglang_server_command
    return shlex.split(given) if given else [sys.executable, "-m", "sglang.launch_server"]


def router_command(cfg: Any) -> list[str]:
    given = cfg.sglang_launch.sglang_router_command
    return shlex.split(given) if given else [sys.executable, "-m", "sglang_router.launch_router"]


def _render(entry: dict[str, Any], value: Any) -> list[str]:
    flag = entry["cli"]
    if entry["kind"] == "bool":
        return [flag] if value else []
    if entry["kind"] == "list":
        return [flag, *map(str, value)]
    return [flag, str(value)]


ROUTER_ALWAYS_PASSED = frozenset({ROUTER_PREFIX + "prometheus_host", ROUTER_PREFIX + "prometheus_port"})


def passthrough_args(group: Any, prefix: str, entry_of, explicit=frozenset()) -> list[str]:
    """The flags of every option in an SGLang group that differs from its default, in snapshot order."""
    out: list[str] = []
    for name, value in changed_values(group).items():
        assert name.startswith(prefix), name
        if name in explicit:
            continue
        out += _render(entry_of(name), value)
    return out


def server_argv(cfg: Any, slot: EngineSlot, *, model_path: str | None = None, seed: int | None = None) -> list[str]:
    """The full argv of the SGLang server of engine `slot.index`; `seed` defaults to --rollout-seed plus
    the engine index (a restarted engine gets a new one from the fleet)."""
    layout = engine_layout(cfg)
    model = model_path or cfg.rollout.hf_checkpoint
    if not model:
        raise UserError("--rollout-backend sglang needs --hf-checkpoint (the model the servers load).", option="--hf-checkpoint")
    argv = [
        *server_command(cfg),
        "--model-path", str(model),
        "--host", slot.host,
        "--port", str(slot.port),
        "--tp-size", str(layout.gpus_per_engine),
        "--random-seed", str(cfg.rollout.rollout_seed + slot.index if seed is None else seed),
        "--nccl-port", str(slot.nccl_port),
        "--skip-server-warmup",
    ]
    if cfg.cluster.offload_rollout:
        argv.append("--enable-memory-saver")
    if layout.nodes_per_engine > 1:
        if slot.dist_init_addr is None:
            raise ValueError(f"engine {slot.index} spans {layout.nodes_per_engine} nodes and needs dist_init_addr")
        argv += ["--nnodes", str(layout.nodes_per_engine), "--node-rank", str(slot.node_rank), "--dist-init-addr", slot.dist_init_addr]
    return argv + passthrough_args(cfg.sglang, SERVER_PREFIX, server_entry)


# Router flags miles sets for its fleet unless the matching --sglang-router-* option is given:
# engines answer /health without generating, so a pause for a weight update does not make the router
# drop them (dead engines are the fleet's health monitor's job); long rollouts must not time out.
ROUTER_FLEET_DEFAULTS = {
    "health_check_endpoint": "/health",
    "request_timeout_secs": 14400,
    "log_level": "warn",
}


def router_argv(
    cfg: Any, *, host: str, port: int, prometheus_port: int, worker_urls: list[str] = (), health_check_interval_s: float | None = None
) -> list[str]:
    """The argv of the sglang-router in front of the engines.

    Engines register themselves as they become healthy (`POST /workers`), so `worker_urls` is usually
    empty. The router's Prometheus exporter binds 0.0.0.0:29000 unless told otherwise, and a second
    router on the host then panics: miles gives it `prometheus_port` on 127.0.0.1 unless the
    `--sglang-router-prometheus-*` options say otherwise. `--policy` is --sglang-router-policy; the
    health check interval is --rollout-health-check-interval; ROUTER_FLEET_DEFAULTS fill the rest
    unless a --sglang-router-* option sets them.
    """
    argv = [*router_command(cfg), "--host", host, "--port", str(port)]
    if worker_urls:
        argv += ["--worker-urls", *worker_urls]
    r = cfg.sglang_router
    argv += ["--prometheus-host", r.sglang_router_prometheus_host]
    argv += ["--prometheus-port", str(r.sglang_router_prometheus_port or prometheus_port)]
    argv += ["--policy", cfg.rollout.sglang_router_policy]
    given = changed_values(r)
    interval = cfg.fault_tolerance.rollout_health_check_interval if health_check_interval_s is None else health_check_interval_s
    defaults = {**ROUTER_FLEET_DEFAULTS, "health_check_interval_secs": int(max(1, interval))}
    for field, value in defaults.items():
        if ROUTER_PREFIX + field not in given:
            argv += [router_entry(ROUTER_PREFIX + field)["cli"], str(value)]
    return argv + passthrough_args(r, ROUTER_PREFIX, router_entry, explicit=ROUTER_ALWAYS_PASSED)


class _Process(Protocol):
    def poll(self) -> int | None: ...


def wait_healthy(
    url: str,
    *,
    what: str,
    timeout_s: float,
    path: str = "/health",
    process: _Process | None = None,
    poll_s: float = HEALTH_POLL_S,
    clock=time.monotonic,
    sleep=time.sleep,
) -> float:
    """Poll `GET url+path` until it answers 200; return the seconds waited.

    Raises RuntimeError at once if `process` exits first (with its exit code), and TimeoutError
    naming `what`, the URL and the timeout if it never answers.
    """
    start = clock()
    last = "no answer yet"
    while True:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"{what} exited with code {process.poll()} before {url}{path} answered; see its log above")
        try:
            with urllib.request.urlopen(url + path, timeout=HEALTH_REQUEST_TIMEOUT_S) as response:
                if response.status == 200:
                    return clock() - start
                last = f"HTTP {response.status}"
        except urllib.error.HTTPError as e:
            last = f"HTTP {e.code}"
        except (urllib.error.URLError, OSError) as e:
            last = str(getattr(e, "reason", e))
        if clock() - start >= timeout_s:
            raise TimeoutError(f"{what} did not answer {url}{path} within {timeout_s:g} s (last: {last}); raise --sglang-server-start-timeout or check its log")
        sleep(poll_s)


def register_worker(router_url: str, worker_url: str, *, timeout_s: float = 30.0) -> None:
    """`POST /workers {"url": ...}` on sglang-router 0.3.x (registration then completes asynchronously)."""
    body = json.dumps({"url": worker_url}).encode()
    request = urllib.request.Request(router_url + "/workers", data=body, headers={"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        if response.status not in (200, 202):
            raise RuntimeError(f"sglang-router at {router_url} refused worker {worker_url}: HTTP {response.status}")


def planned_processes(cfg: Any) -> list[tuple[str, list[str]]]:
    """(name, argv) of every SGLang process a run starts, with placeholder addresses, for --dry-run."""
    layout = engine_layout(cfg)
    out = []
    for i in range(layout.num_engines):
        for rank in range(layout.nodes_per_engine):
            slot = EngineSlot(
                index=i, host="<node ip>", port=30000 + 2 * i, nccl_port=30001 + 2 * i, node_rank=rank,
                dist_init_addr="<engine node 0 ip>:<port>" if layout.nodes_per_engine > 1 else None,
            )
            suffix = f" (node {rank} of {layout.nodes_per_engine})" if layout.nodes_per_engine > 1 else ""
            out.append((f"SGLang engine {i}{suffix}, {layout.gpus_per_engine} GPUs", server_argv(cfg, slot)))
    out.append(("sglang-router", router_argv(cfg, host="<driver ip>", port=31000, prometheus_port=31001)))
    return out
