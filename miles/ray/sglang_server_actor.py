"""`SGLangServerActor`: one SGLang server process, started and owned by a Ray actor on the engine's node.

`--rollout-backend sglang` makes an `EngineFleet` (miles/rollout/engine/fleet.py) whose engine actors
are these instead of built-in engine servers; everything after the server answers (the router, the
client, weight updates, health monitor, restarts) is the fleet's, the same for both backends.

The actor picks the node's address (127.0.0.1 on the private local Ray node, Ray's node IP on a
cluster) and two free ports, sets CUDA_VISIBLE_DEVICES to the GPUs of the engine's placement bundles
(empty with --device cpu), runs `server_argv(...)` from launch.py (`<--sglang-server-command>
--model-path ... --host ... --port ... --tp-size N ...`) with its output in
`<run dir>/sglang-engine-<i>.log`, and waits for `/health` within --sglang-server-start-timeout; a
server that exits first, or never answers, fails the actor with a sentence naming the engine, the
command and the log. The server gets SIGTERM when the actor dies (PR_SET_PDEATHSIG), and `stop()`
ends its whole process group (SGLang's scheduler and detokenizer processes included).

An engine spanning nodes (--rollout-num-gpus-per-engine above --actor-num-gpus-per-node) is one
process per node, all from the same argv but `--node-rank` (`--nnodes`, `--dist-init-addr` = node 0's
address and a free port there). The actor of node rank 0 is the engine the fleet sees: it serves HTTP
and is the engine's address. It starts one `SGLangNodeActor` per other node (in `nodes`: each node's
placement bundle and GPU ids), then its own server, and waits for `/health` while checking that every
node's process is still up, within --sglang-server-start-timeout; the error names the node that
exited or what it waited for. Its `stop()` stops every node (each its own process group); the node
actors are owned by it, so they die with it. A watcher kills node 0's server as soon as any other
node's process exits, so the fleet's health check finds the engine dead and its restart path starts
all nodes again (an SGLang engine with a lost node cannot serve anyway).

    actor = ray.remote(SGLangServerActor).options(**bundle).remote(cfg, index=0, seed=42, log_dir="runs/x")
    url = ray.get(actor.url.remote())      # http://127.0.0.1:PORT, healthy
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import threading
from pathlib import Path
from typing import Any

from miles.rollout.sglang.launch import EngineSlot, engine_layout, server_argv, wait_healthy
from miles.utils.net import free_port

# Seconds `stop()` gives the server's process group to exit after SIGTERM before SIGKILL.
STOP_GRACE_S = 15.0
# How often node 0 checks that the other nodes of its engine are up (and the timeout of that call).
NODE_WATCH_S = 1.0
NODE_CALL_TIMEOUT_S = 30.0


def _die_with_parent() -> None:
    """Linux: the server gets SIGTERM when the actor that launched it dies (no orphan holds a GPU)."""
    import sys

    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def node_host(cfg: Any) -> str:
    """Where the server listens: loopback on the private local node, the node's IP on a cluster (the
    router, on the rollout manager's node, must reach it)."""
    if not cfg.cluster.ray_address:
        return "127.0.0.1"
    import ray

    return ray.util.get_node_ip_address()


def gpu_ids_of_bundles(bundle_options: list[dict[str, Any]], *, timeout_s: float = 120.0) -> list[str]:
    """The GPU ids Ray gave each placement bundle (one tiny task per bundle), in bundle order."""
    import ray

    @ray.remote(num_cpus=0, num_gpus=0.01)
    def probe() -> list[str]:
        return [str(g) for g in ray.get_gpu_ids()]

    refs = [probe.options(**opts).remote() for opts in bundle_options]
    try:
        found = ray.get(refs, timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        raise TimeoutError(f"timed out after {timeout_s:.0f} s waiting for Ray to report the GPU ids of {len(refs)} placement bundles") from None
    return [g for ids in found for g in ids]


def _server_env(cfg: Any, gpu_ids: list[str] | None) -> dict[str, str]:
    env = dict(os.environ)
    # SGLang's /health generates a token by default, so a server paused for a weight update would fail
    # the router's health checks (and the fleet's liveness check); the fleet's monitor asks
    # /health_generate for that explicitly. A value the user set wins.
    env.setdefault("SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION", "false")
    if gpu_ids is not None:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(gpu_ids)
    elif cfg.cluster.device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def _launch(argv: list[str], env: dict[str, str], log_path: Path, header: str) -> subprocess.Popen:
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("ab") as log:
        log.write(f"{header}: {' '.join(argv)}\n".encode())
        log.flush()
        # Its own process group, so stop() ends SGLang's scheduler/detokenizer children too and never
        # signals the Ray worker.
        return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True, preexec_fn=_die_with_parent)


def _stop_group(process: subprocess.Popen) -> None:
    """SIGTERM to a server's process group, SIGKILL after STOP_GRACE_S."""
    if process.poll() is not None:
        return
    try:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=STOP_GRACE_S)
    except ProcessLookupError:
        pass


def _tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def _node_id() -> str | None:
    try:
        import ray

        return ray.get_runtime_context().get_node_id()
    except Exception:  # noqa: BLE001 - not in a Ray worker (tests run the class in-process)
        return None


class SGLangNodeActor:
    """Hosted by a Ray actor on one of the other nodes of an engine spanning nodes: runs that node's
    server process (the same argv as node 0's but `--node-rank`), which joins node 0 and serves no HTTP."""

    def __init__(self, argv: list[str], *, cfg: Any, index: int, node_rank: int, log_dir: str | None, gpu_ids: list[str] | None):
        self.argv = argv
        self.node_rank = node_rank
        self.env = _server_env(cfg, gpu_ids)
        self.log_path = Path(log_dir or ".") / f"sglang-engine-{index}-node-{node_rank}.log"
        self.process = _launch(argv, self.env, self.log_path, f"[miles] engine {index} node {node_rank}")

    def exit_code(self) -> int | None:
        return self.process.poll()

    def info(self) -> dict[str, Any]:
        return {
            "node_rank": self.node_rank, "argv": self.argv, "pid": self.process.pid, "node_id": _node_id(),
            "cuda_visible_devices": self.env.get("CUDA_VISIBLE_DEVICES"), "log": str(self.log_path),
        }  # fmt: skip

    def log_tail(self, lines: int = 30) -> str:
        return _tail(self.log_path, lines)

    def stop(self) -> None:
        _stop_group(self.process)


class SGLangServerActor:
    """Hosted by a Ray actor: one SGLang server (`server_argv`) on this node; see the module docstring.

    `nodes` (an engine spanning nodes): for node ranks 1.., the Ray options of the node's actor (its
    placement bundle) under "actor_options" and its GPU ids under "gpu_ids"."""

    def __init__(
        self,
        cfg: Any,
        *,
        index: int,
        seed: int,
        log_dir: str | None = None,
        gpu_ids: list[str] | None = None,
        nodes: list[dict[str, Any]] | None = None,
    ):
        layout = engine_layout(cfg)
        self.index = index
        self.nodes: list[Any] = []  # the SGLangNodeActor handles of node ranks 1..
        self._nodes_info: list[dict[str, Any]] = []
        self._stopping = threading.Event()
        spans = layout.nodes_per_engine > 1
        if spans and len(nodes or []) != layout.nodes_per_engine - 1:
            raise ValueError(f"engine {index} spans {layout.nodes_per_engine} nodes and got placements for {1 + len(nodes or [])}")
        # Other nodes must reach node 0 (its dist-init address): its address as Ray knows it.
        host = _node_ip() if spans else node_host(cfg)
        slot = EngineSlot(
            index=index, host=host, port=free_port(host), nccl_port=free_port(host),
            dist_init_addr=f"{host}:{free_port(host)}" if spans else None,
        )  # fmt: skip
        self.argv = server_argv(cfg, slot, seed=seed)
        self.url_ = f"http://{host}:{slot.port}"
        env = _server_env(cfg, gpu_ids)
        self.cuda_visible_devices = env.get("CUDA_VISIBLE_DEVICES")
        self.log_path = Path(log_dir or ".") / f"sglang-engine-{index}.log"
        what = f"SGLang engine {index} (`{' '.join(self.argv[:3])} ...`, log {self.log_path})"
        self.process = None
        try:
            if spans:
                self._start_nodes(cfg, slot, seed, log_dir, nodes or [])
                what = f"SGLang engine {index} on {layout.nodes_per_engine} nodes (node 0: `{' '.join(self.argv[:3])} ...`, log {self.log_path})"
            self.process = _launch(self.argv, env, self.log_path, f"[miles] engine {index}")
            wait_healthy(
                self.url_, what=what, timeout_s=cfg.sglang_launch.sglang_server_start_timeout,
                process=_AllUp(self.process, self._node_exit_codes) if spans else self.process,
            )  # fmt: skip
        except BaseException as e:
            message, tail = str(e), self.log_tail()
            dead = [(r, c) for r, c in self._node_exit_codes() if c is not None] if self.nodes else []
            if dead:  # name the node that went first, with its own log
                rank, code = dead[0]
                message = f"node {rank} of SGLang engine {index} exited with code {code} before the engine answered /health ({e})"
                tail = self._node_log_tail(rank) or tail
            self.stop()
            raise RuntimeError(f"{message}\n{tail}") from None
        if spans:
            threading.Thread(target=self._watch_nodes, name=f"miles-engine-{index}-nodes", daemon=True).start()

    def _start_nodes(self, cfg: Any, slot: EngineSlot, seed: int, log_dir: str | None, nodes: list[dict[str, Any]]) -> None:
        import ray

        cls = ray.remote(SGLangNodeActor)
        for rank, node in enumerate(nodes, start=1):
            argv = server_argv(cfg, dataclasses.replace(slot, node_rank=rank), seed=seed)
            opts = {"num_cpus": 0, **node.get("actor_options", {}), "max_restarts": 0}
            self.nodes.append(
                cls.options(**opts).remote(argv, cfg=cfg, index=self.index, node_rank=rank, log_dir=log_dir, gpu_ids=node.get("gpu_ids"))
            )
        try:
            self._nodes_info = ray.get([n.info.remote() for n in self.nodes], timeout=cfg.sglang_launch.sglang_server_start_timeout)
        except ray.exceptions.GetTimeoutError:
            raise TimeoutError(
                f"timed out after {cfg.sglang_launch.sglang_server_start_timeout:g} s waiting for Ray to place the "
                f"{len(nodes)} other node(s) of SGLang engine {self.index}"
            ) from None

    def _node_exit_codes(self) -> list[tuple[int, int | None]]:
        """(node rank, exit code or None while running) of every other node; a dead actor counts as exited."""
        import ray

        out = []
        for rank, node in enumerate(self.nodes, start=1):
            try:
                out.append((rank, ray.get(node.exit_code.remote(), timeout=NODE_CALL_TIMEOUT_S)))
            except Exception:  # noqa: BLE001 - the node's actor is gone (or hangs): its server is not serving
                out.append((rank, -1))
        return out

    def _node_log_tail(self, rank: int) -> str:
        import ray

        try:
            return ray.get(self.nodes[rank - 1].log_tail.remote(), timeout=NODE_CALL_TIMEOUT_S)
        except Exception:  # noqa: BLE001 - its actor is gone: no log to show from here
            return ""

    def _watch_nodes(self) -> None:
        """An engine that lost a node cannot serve: end node 0's server, so the fleet restarts all nodes."""
        while not self._stopping.wait(NODE_WATCH_S):
            dead = [(r, c) for r, c in self._node_exit_codes() if c is not None]
            if dead and not self._stopping.is_set():
                rank, code = dead[0]
                with self.log_path.open("ab") as log:
                    log.write(f"[miles] engine {self.index}: node {rank} exited (code {code}); stopping node 0 so the engine restarts\n".encode())
                _stop_group(self.process)
                return

    def url(self) -> str:
        return self.url_

    def pid(self) -> int:
        """The server's pid (what a person would kill to test fault tolerance), not the actor's."""
        return self.process.pid

    def info(self) -> dict[str, Any]:
        return {
            "argv": self.argv, "pid": self.process.pid, "cuda_visible_devices": self.cuda_visible_devices, "log": str(self.log_path),
            "node_id": _node_id(), "nodes": list(self._nodes_info),
        }  # fmt: skip

    def log_tail(self, lines: int = 30) -> str:
        return _tail(self.log_path, lines)

    def stop(self) -> None:
        """Every node's server: SIGTERM to each process group, SIGKILL after STOP_GRACE_S; then the node actors."""
        import contextlib

        self._stopping.set()
        if self.process is not None:
            _stop_group(self.process)
        if self.nodes:
            import ray

            with contextlib.suppress(Exception):
                ray.get([n.stop.remote() for n in self.nodes], timeout=STOP_GRACE_S * 2 + 5)
            for n in self.nodes:
                with contextlib.suppress(Exception):
                    ray.kill(n, no_restart=True)


class _AllUp:
    """A `process` for wait_healthy: "exited" as soon as node 0 or any other node of the engine has."""

    def __init__(self, process: subprocess.Popen, node_exit_codes):
        self.process, self.node_exit_codes = process, node_exit_codes

    def poll(self) -> int | None:
        code = self.process.poll()
        if code is not None:
            return code
        return next((c for _, c in self.node_exit_codes() if c is not None), None)


def _node_ip() -> str:
    import ray

    return ray.util.get_node_ip_address()
