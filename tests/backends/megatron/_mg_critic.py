"""A spawned gloo worker for the megatron critic test: every rank builds `MegatronTrainer(role="critic")`,
trains it on a few rollouts with `miles.train.step.train_critic`, saves after the first, and rank 0
writes the metrics, the values and the value head; a second job loads and continues."""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))


def _worker(rank: int, world: int, port: int, job: dict, out_dir: str) -> None:
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    from datetime import timedelta

    import torch.distributed as dist

    from _mg_reference import make_train_data

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=120))
    from miles.backends.megatron.trainer import MegatronTrainer
    from miles.config.resolve import build_config, fill_derived
    from miles.train.step import train_critic

    cfg = fill_derived(build_config(job["config"]))
    trainer = MegatronTrainer(cfg, rank=rank, world_size=world, device="cpu", role="critic")
    if job.get("load"):
        trainer.load_checkpoint(job["load"])
    out = {"metrics": [], "values": []}
    first = trainer.model.module.output_layer if trainer.ps.is_pipeline_last_stage() else None
    out["head0"] = None if first is None else {k: v.detach().clone() for k, v in first.state_dict().items()}
    for k, seed in enumerate(job["rollouts"]):
        data = make_train_data(8, seed=seed, vocab=trainer.shape.vocab_size)
        metrics, values = train_critic(trainer, data, rollout_id=k)
        out["metrics"].append(metrics)
        out["values"].append(values)
        if job.get("save") and k == 0:
            trainer.save_checkpoint(job["save"])
    head = trainer.model.module.output_layer if trainer.ps.is_pipeline_last_stage() else None
    out["head"] = None if head is None else {k: v.detach().clone() for k, v in head.state_dict().items()}
    if rank == 0:
        torch.save(out, os.path.join(out_dir, "critic.pt"))
    dist.destroy_process_group()


def run(world: int, job: dict, out_dir: Path, timeout: float = 300) -> dict:
    import torch.multiprocessing as mp

    from _mg_workers import free_port

    import time

    Path(out_dir).mkdir(parents=True, exist_ok=True)
    ctx = mp.start_processes(_worker, args=(world, free_port(), job, str(out_dir)), nprocs=world, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout
    while not ctx.join(timeout=max(0.1, deadline - time.monotonic())):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            raise TimeoutError(f"{world} megatron critic rank(s) did not finish within {timeout} s")
    return torch.load(out_dir / "critic.pt", weights_only=False)
