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

    actor = ray.remote(SGLangServerActor).options(**bundle).remote(cfg, index=0, seed=42, log_dir="runs/x")
    url = ray.get(actor.url.remote())      # http://127.0.0.1:PORT, healthy
"""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path
from typing import Any

from miles.rollout.sglang.launch import EngineSlot, engine_layout, server_argv, wait_healthy

# Seconds `stop()` gives the server's process group to exit after SIGTERM before SIGKILL.
STOP_GRACE_S = 15.0


def _free_port(host: str) -> int:
    import socket

    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


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


class SGLangServerActor:
    """Hosted by a Ray actor: one SGLang server (`server_argv`) on this node; see the module docstring."""

    def __init__(
        self,
        cfg: Any,
        *,
        index: int,
        seed: int,
        log_dir: str | None = None,
        gpu_ids: list[str] | None = None,
    ):
        layout = engine_layout(cfg)
        if layout.nodes_per_engine > 1:
            from miles.errors import UserError

            raise UserError(
                f"--rollout-num-gpus-per-engine {layout.gpus_per_engine} spans {layout.nodes_per_engine} nodes of "
                f"{layout.gpus_per_node} GPUs; this build launches SGLang engines within one node (--dry-run prints the "
                "multi-node plan); lower --rollout-num-gpus-per-engine to at most --actor-num-gpus-per-node.",
                option="--rollout-num-gpus-per-engine",
            )
        self.index = index
        host = node_host(cfg)
        slot = EngineSlot(index=index, host=host, port=_free_port(host), nccl_port=_free_port(host))
        self.argv = server_argv(cfg, slot, seed=seed)
        self.url_ = f"http://{host}:{slot.port}"
        env = dict(os.environ)
        # SGLang's /health generates a token by default, so a server paused for a weight update would fail
        # the router's health checks (and the fleet's liveness check); the fleet's monitor asks
        # /health_generate for that explicitly. A value the user set wins.
        env.setdefault("SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION", "false")
        if gpu_ids is not None:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(gpu_ids)
        elif cfg.cluster.device == "cpu":
            env["CUDA_VISIBLE_DEVICES"] = ""
        self.cuda_visible_devices = env.get("CUDA_VISIBLE_DEVICES")
        self.log_path = Path(log_dir or ".") / f"sglang-engine-{index}.log"
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = self.log_path.open("ab")
        log.write(f"[miles] engine {index}: {' '.join(self.argv)}\n".encode())
        log.flush()
        # Its own process group, so stop() ends SGLang's scheduler/detokenizer children too and never
        # signals the Ray worker.
        self.process = subprocess.Popen(
            self.argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True, preexec_fn=_die_with_parent
        )
        log.close()
        what = f"SGLang engine {index} (`{' '.join(self.argv[:3])} ...`, log {self.log_path})"
        try:
            wait_healthy(self.url_, what=what, timeout_s=cfg.sglang_launch.sglang_server_start_timeout, process=self.process)
        except BaseException as e:
            self.stop()
            raise RuntimeError(f"{e}\n{self.log_tail()}") from None

    def url(self) -> str:
        return self.url_

    def pid(self) -> int:
        """The server's pid (what a person would kill to test fault tolerance), not the actor's."""
        return self.process.pid

    def info(self) -> dict[str, Any]:
        return {"argv": self.argv, "pid": self.process.pid, "cuda_visible_devices": self.cuda_visible_devices, "log": str(self.log_path)}

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self) -> None:
        """SIGTERM to the server's process group, SIGKILL after STOP_GRACE_S."""
        if self.process.poll() is not None:
            return
        try:
            os.killpg(self.process.pid, signal.SIGTERM)
            self.process.wait(timeout=STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=STOP_GRACE_S)
        except ProcessLookupError:
            pass
