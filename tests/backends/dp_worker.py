"""The body of one data-parallel rank for test_data_parallel.py (a module of its own, so a spawned
process can import it). Runs the same rollouts as the single-process reference and saves its weights."""

from __future__ import annotations

import datetime
import json


def run_rank(rank: int, world_size: int, port: int, hf_dir: str, out_dir: str, algo: dict | None = None, n: int = 2) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=60),
    )
    try:
        weights, metrics = train_reference_rollouts(hf_dir, dp_rank=rank, dp_world_size=world_size, algo=algo, n=n)
        if rank == 0:
            torch.save(weights, f"{out_dir}/weights.pt")
            with open(f"{out_dir}/metrics.json", "w") as f:
                json.dump(metrics, f)
    finally:
        dist.destroy_process_group()


def train_reference_rollouts(hf_dir: str, *, dp_rank: int = 0, dp_world_size: int = 1, algo: dict | None = None, n: int = 2):
    """Two rollouts of 8 samples, 2 optimizer steps of 4 each, micro-batch 2, policy loss + KL loss
    (`algo` overrides AlgoConfig fields, e.g. normalize_advantages; `n` is --n-samples-per-prompt)."""
    from backend_fixtures import make_train_data

    from miles.backends.torch import TorchTrainer
    from miles.config.algo import AlgoConfig
    from miles.config.optimizer import OptimizerConfig

    trainer = TorchTrainer(
        hf_dir,
        optimizer_cfg=OptimizerConfig(lr=1e-2, weight_decay=0.1, lr_warmup_iters=2),
        algo_cfg=AlgoConfig(
            **{"eps_clip_high": 0.2, "use_kl_loss": True, "kl_loss_coef": 0.1, "calculate_per_token_loss": True, **(algo or {})}
        ),
        micro_batch_size=2,
        deterministic=True,
        seed=1234,
        dp_rank=dp_rank,
        dp_world_size=dp_world_size,
    )
    metrics = []
    for rollout_id in range(2):
        data = make_train_data(8, seed=200 + rollout_id)
        m = trainer.train_step(data, rollout_id=rollout_id, global_batch_size=4, num_steps_per_rollout=2, n_samples_per_prompt=n)
        metrics.append({k: v for k, v in m.items() if k.startswith("train/")})
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}, metrics
