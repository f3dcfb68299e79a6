"""Make the rollout engine a run asks for: `--rollout-backend`, and whether engines are servers.

    builtin, --rollout-num-gpus unset  ->  BuiltinEngine in this process (the fastest on a CPU)
    builtin, --rollout-num-gpus N      ->  EngineFleet: N built-in engine servers behind sglang-router
    sglang                             ->  refused by resolve() until the SGLang launcher exists; it will
                                           be an EngineFleet of SGLang servers (same client, same router)

Every result is a `RolloutEngine`, so the rollout manager never asks which one it got.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from miles.config.engine import EngineConfig
from miles.errors import UserError
from miles.rollout.engine.base import RolloutEngine


def make_engine(
    cfg: EngineConfig,
    *,
    device: str = "cpu",
    actor_options: list[dict[str, Any]] | None = None,
    log_dir: str | Path | None = None,
) -> RolloutEngine:
    r, c = cfg.rollout, cfg.cluster
    if r.rollout_backend != "builtin":
        raise UserError(
            f"--rollout-backend {r.rollout_backend} cannot run yet: the SGLang launcher is not built; use --rollout-backend builtin.",
            option="--rollout-backend",
        )
    if c.rollout_num_gpus is None:
        from miles.rollout.engine.builtin import BuiltinEngine

        return BuiltinEngine(r.hf_checkpoint, device=device, max_batch_size=r.rollout_max_batch_size, seed=r.rollout_seed)
    from miles.rollout.engine.fleet import EngineFleet

    return EngineFleet(
        r.hf_checkpoint,
        num_engines=c.rollout_num_gpus // c.rollout_num_gpus_per_engine,
        policy=r.sglang_router_policy,
        ft=cfg.fault_tolerance,
        max_batch_size=r.rollout_max_batch_size,
        seed=r.rollout_seed,
        device=device,
        actor_options=actor_options,
        log_dir=log_dir,
    )
