"""Make the rollout engine a run asks for: `--rollout-backend`, and whether engines are servers.

    builtin, --rollout-num-gpus unset  ->  BuiltinEngine in this process (the fastest on a CPU)
    builtin, --rollout-num-gpus N      ->  EngineFleet: N built-in engine servers behind sglang-router
    sglang                             ->  EngineFleet: one SGLang server per --rollout-num-gpus-per-engine
                                           GPUs (`--sglang-server-command`, SGLangServerActor), behind
                                           sglang-router started from --sglang-router-command and the
                                           --sglang-router-* options; same client, same fleet

Every result is a `RolloutEngine`, so the rollout manager never asks which one it got. Engine servers
are Ray actors (`RayEngineLauncher`), which is why this lives in miles.ray: miles.rollout imports no Ray.
"""

from __future__ import annotations

import functools

from pathlib import Path
from typing import Any

from miles.config.engine import EngineConfig
from miles.ray.engine_launcher import RayEngineLauncher
from miles.ray.threads import apply_share, share_of
from miles.rollout.engine.base import RolloutEngine


def make_engine(
    cfg: EngineConfig,
    *,
    device: str = "cpu",
    actor_options: list[dict[str, Any]] | None = None,
    log_dir: str | Path | None = None,
) -> RolloutEngine:
    """`actor_options[i]`: Ray options of engine i's actor (its placement bundle). For SGLang, an entry
    may also hold "gpu_bundles": the Ray options of each bundle whose GPU the engine uses, whose GPU
    ids become the server's CUDA_VISIBLE_DEVICES; and, for an engine spanning nodes, "node_bundles":
    the Ray options of the first bundle of each of its other nodes (where their processes run)."""
    r, c = cfg.rollout, cfg.cluster
    if r.rollout_backend == "sglang":
        return _sglang_fleet(cfg, actor_options=actor_options, log_dir=log_dir)
    if c.rollout_num_gpus is None:
        from miles.rollout.engine.builtin import BuiltinEngine

        return BuiltinEngine(
            r.hf_checkpoint, device=device, dtype=r.rollout_dtype, max_batch_size=r.rollout_max_batch_size, seed=r.rollout_seed
        )
    return builtin_fleet(
        r.hf_checkpoint,
        num_engines=c.rollout_num_gpus // c.rollout_num_gpus_per_engine,
        policy=r.sglang_router_policy,
        ft=cfg.fault_tolerance,
        max_batch_size=r.rollout_max_batch_size,
        seed=r.rollout_seed,
        device=device,
        dtype=r.rollout_dtype,
        actor_options=actor_options,
        log_dir=log_dir,
        shares=[share_of(cfg, ("engine", i)) for i in range(c.rollout_num_gpus // c.rollout_num_gpus_per_engine)],
    )


def builtin_fleet(
    hf_dir: str,
    *,
    num_engines: int,
    policy: str,
    ft,
    max_batch_size: int = 256,
    seed: int = 0,
    device: str = "cpu",
    dtype: str = "float32",
    actor_options: list[dict[str, Any]] | None = None,
    log_dir: str | Path | None = None,
    shares: list | None = None,
):
    """`num_engines` built-in engine servers (`EngineServerActor`, one Ray actor each) behind the router.
    `shares[i]`: server i's `miles.ray.threads.Share` of its node's cores (None: one torch thread)."""
    from miles.rollout.engine.fleet import EngineFleet, EngineServerActor

    def make_actor(index: int, seed: int):
        share = shares[index] if shares else None
        return EngineServerActor, (hf_dir,), dict(
            seed=seed, max_batch_size=max_batch_size, device=device, dtype=dtype,
            set_threads=None if share is None else functools.partial(apply_share, share),
        )

    return EngineFleet(
        RayEngineLauncher(make_actor, actor_options), num_engines=num_engines, policy=policy, ft=ft, seed=seed, log_dir=log_dir
    )


def _sglang_fleet(cfg: EngineConfig, *, actor_options: list[dict[str, Any]] | None, log_dir: str | Path | None) -> RolloutEngine:
    from miles.ray.sglang_server_actor import SGLangServerActor, gpu_ids_of_bundles
    from miles.rollout.engine.fleet import EngineFleet
    from miles.rollout.sglang.launch import engine_layout, router_argv

    layout = engine_layout(cfg)
    options = [dict(o) for o in (actor_options or [{} for _ in range(layout.num_engines)])]
    gpu_bundles = [o.pop("gpu_bundles", None) for o in options]
    node_bundles = [o.pop("node_bundles", None) or [{} for _ in range(layout.nodes_per_engine - 1)] for o in options]
    gpu_ids: dict[int, list[str]] = {}  # bundles do not move: probed once, reused by restarts

    def make_actor(index: int, seed: int):
        if gpu_bundles[index] and index not in gpu_ids:
            gpu_ids[index] = gpu_ids_of_bundles(gpu_bundles[index])
        ids, per = gpu_ids.get(index), layout.gpus_per_node
        kwargs = dict(index=index, seed=seed, log_dir=None if log_dir is None else str(log_dir), gpu_ids=ids)
        if layout.nodes_per_engine > 1:  # each node's process sees its own node's GPUs
            kwargs["gpu_ids"] = None if ids is None else ids[:per]
            kwargs["nodes"] = [
                {"actor_options": opts, "gpu_ids": None if ids is None else ids[r * per : (r + 1) * per]}
                for r, opts in enumerate(node_bundles[index], start=1)
            ]
        return SGLangServerActor, (cfg,), kwargs

    return EngineFleet(
        RayEngineLauncher(make_actor, options),
        num_engines=layout.num_engines,
        policy=cfg.rollout.sglang_router_policy,
        ft=cfg.fault_tolerance,
        seed=cfg.rollout.rollout_seed,
        log_dir=log_dir,
        router_argv_for=lambda port, prom, urls: router_argv(cfg, host="127.0.0.1", port=port, prometheus_port=prom, worker_urls=urls),
        max_in_flight=cfg.rollout.sglang_server_concurrency * layout.num_engines,
    )
