"""Set up a run's Ray cluster: the Ray session, the device, the placement group, the rollout manager
actor and the training group — everything the driver loop needs before its first step, and the
reverse when it ends.

Ray starts in-process (a private local node) unless --ray-address / RAY_ADDRESS names a cluster.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import signal
from pathlib import Path
from typing import Any

from miles.config.engine import EngineConfig
from miles.config.resolve import resolve_device, resolve_num_rollout
from miles.ray.hosting import HostedActor
from miles.ray.waiting import ACTOR_START_TIMEOUT_S, wait


@dataclasses.dataclass
class Cluster:
    """The run's actors: the rollout manager (`RolloutManagerActor`) and the training ranks (`TrainGroup`)."""

    manager: HostedActor
    trainer: Any  # miles.ray.train_group.TrainGroup
    device: str
    critic: Any = None  # PPO's critic TrainGroup (--advantage-estimator ppo), on the trainer's bundles


class _DropDefaultTokenAuthNotice(logging.Filter):
    """Drops the one notice Ray logs on every new local node, that token authentication is on (its default).
    The protection stays as Ray chose it; only the line goes, so a run's console starts with miles' own
    output. Ray's other authentication messages (a disabled mode, a wrong token) still print."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Token authentication is enabled for this Ray cluster")


def _quiet_default_token_auth_notice() -> None:
    log = logging.getLogger("ray._private.authentication.authentication_token_setup")
    if not any(isinstance(f, _DropDefaultTokenAuthNotice) for f in log.filters):
        log.addFilter(_DropDefaultTokenAuthNotice())


# The private local node's Ray settings (only for the node started here: a cluster's system config is
# its own, and Ray refuses `_system_config` when connecting to one). docs/benchmarks.md has the
# measurements ("Run start-up" and "Start-up and memory, 2026-12-04").
LOCAL_NODE_SYSTEM_CONFIG = {
    # No idle Python workers ahead of demand. Ray pre-starts one per CPU for the first driver, but every
    # miles actor runs in the job's runtime environment (its env vars), so none of them could host an
    # actor: each idle worker was ~85 MB of RSS and a second of CPU at start.
    "prestart_worker_first_driver": False,
    "enable_worker_prestart": False,
    # The actors run at the driver's priority. Ray starts workers at nice 15 so that a shared node's
    # tasks never starve its raylet; on a run's own node the workers are the run, and at nice 15 they
    # got a small share of the CPU beside anything else at nice 0 (the driver's imports, Ray's own
    # processes, the rest of the machine) while a single-process trainer (TRL) runs at nice 0.
    "worker_niceness": 0,
    # No Ray metrics: nothing reads them on this node (no dashboard, no Prometheus scrape of Ray), and
    # recording and reporting them cost the workers and the dashboard agent CPU at start (~0.6 s of
    # the node's ~4.4 s) and every few seconds after.
    "enable_metrics_collection": False,
}


@contextlib.contextmanager
def ray_session(cfg: EngineConfig, env: dict[str, str], num_cpus: int):
    import ray

    from miles.ray.threads import USER_CAP_ENV, user_thread_cap

    started_here = not ray.is_initialized()
    if started_here:
        cap = user_thread_cap()
        if not cfg.cluster.ray_address and hasattr(os, "getloadavg"):
            from miles.ray.threads import busy_node_hint, node_cores

            hint = busy_node_hint(len(node_cores()), os.getloadavg()[0], cap)
            if hint:
                from rich import get_console

                get_console().print(hint, markup=False, highlight=False, soft_wrap=True)
        kwargs: dict[str, Any] = dict(
            include_dashboard=False,
            log_to_driver=True,
            runtime_env={
                "env_vars": {
                    **env, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
                    **({USER_CAP_ENV: str(cap)} if cap else {}),
                }
            },
            configure_logging=False,
        )
        # ray.init replaces the SIGTERM handler with a bare sys.exit; keep the caller's (miles.run_stop).
        sigterm = signal.getsignal(signal.SIGTERM)
        if cfg.cluster.ray_address:
            ray.init(address=cfg.cluster.ray_address, **kwargs)
        else:  # "local": a private node, even when another Ray on this machine left /tmp/ray/ray_current_cluster
            _quiet_default_token_auth_notice()
            ray.init(address="local", num_cpus=num_cpus, _system_config=LOCAL_NODE_SYSTEM_CONFIG, **kwargs)
        if sigterm is not None:
            signal.signal(signal.SIGTERM, sigterm)
    try:
        yield
    finally:
        if started_here:
            from miles.ray.hosting import end_hosted_actors

            pids = end_hosted_actors()
            ray.shutdown()
            if not cfg.cluster.ray_address:
                _reap(pids)


def _reap(pids: list[int], timeout: float = 10.0) -> None:
    """Make sure the local actor processes are gone once Ray is shut down (no orphan keeps a GPU or a port)."""
    import psutil

    procs = []
    for pid in pids:
        try:
            p = psutil.Process(pid)
            if any(part.startswith("ray::") for part in p.cmdline()[:1]):
                procs.append(p)
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(procs, timeout=timeout)
    for p in alive:
        with contextlib.suppress(psutil.Error):
            p.kill()
    psutil.wait_procs(alive, timeout=timeout)


def torch_device_count() -> int:
    import torch

    return torch.cuda.device_count()


def _available_gpus(cfg: EngineConfig) -> float:
    """GPUs the run may use: those visible here on a private local node, Ray's count on a cluster."""
    if not cfg.cluster.ray_address:
        return float(torch_device_count())
    import ray

    return float(ray.cluster_resources().get("GPU", 0))


@contextlib.contextmanager
def start_cluster(cfg: EngineConfig, *, run_dir: Path, env: dict[str, str], stack=None):
    """Yields the run's `Cluster`; Ray, the placement group and the actors end with the block.

    The trainers need nothing from the manager unless --num-epoch leaves the step count to the
    dataset's size; otherwise they start and load the model while the manager loads the engine and the
    datasets (side by side, instead of one after the other)."""
    from miles.ray.placement import check_gpu_count, engine_actor_options, placement

    layout = cfg.layout
    num_cpus = max(os.cpu_count() or 1, layout.train_ranks + layout.engine_bundles)
    with contextlib.ExitStack() as session:
        session.enter_context(ray_session(cfg, env, num_cpus))
        if stack is not None:
            stack.join()
        from miles.ray.actors import RolloutManagerActor, TrainWorkerActor
        from miles.ray.hosting import start_actor
        from miles.ray.device import pick_device
        from miles.ray.train_group import TrainGroup

        device = pick_device(cfg.cluster.device)
        resolve_device(cfg, device)
        # Colocated actors take turns on the same devices: each asks for half a device (and half a CPU) so
        # Ray places a trainer and the engine together; separate placement gives each a whole device.
        share = 0.5 if layout.colocate else 1.0
        options: dict[str, Any] = {"num_cpus": share, **({"num_gpus": share} if device == "cuda" else {})}
        ppo = cfg.algo.advantage_estimator == "ppo"
        # PPO's critic rank shares its actor rank's device (upstream's layout): the two split its share.
        train_share = share / 2 if ppo else share
        train_options = {"num_cpus": train_share, **({"num_gpus": train_share} if device == "cuda" else {})}
        if device == "cuda":
            check_gpu_count(cfg, _available_gpus(cfg))
        bundle_of = session.enter_context(placement(cfg, device))
        if layout.engine_servers:  # engine servers in their own bundles; the manager only coordinates
            kwargs = dict(engine_actor_options=engine_actor_options(cfg, options, bundle_of, device), log_dir=str(run_dir))
            manager = start_actor(RolloutManagerActor, cfg, label="the RolloutManager", actor_options={"num_cpus": 0}, **kwargs)
        else:
            manager = start_actor(RolloutManagerActor, cfg, label="the RolloutManager", actor_options={**options, **bundle_of("rollout")})

        def start_trainer(role: str = "actor"):
            return TrainGroup.start(cfg, TrainWorkerActor, device=device, role=role,
                                    actor_options=lambda rank: {**train_options, **bundle_of(rank)})

        trainer = start_trainer() if cfg.data.num_rollout is not None else None
        critic = start_trainer("critic") if ppo and trainer is not None else None
        wait(manager.ready_ref, "the rollout manager to load the engine and the datasets", ACTOR_START_TIMEOUT_S)
        if trainer is None:  # --num-epoch: the dataset size decides the number of steps (and the LR decay)
            resolve_num_rollout(cfg, wait(manager.handle.num_prompts.remote(), "the rollout manager"))
            trainer = start_trainer()
            critic = start_trainer("critic") if ppo else None
        from miles.ray.hosting import freeze_startup_objects

        freeze_startup_objects()  # the driver's imports: out of the collections its loop triggers
        yield Cluster(manager, trainer, device, critic)
