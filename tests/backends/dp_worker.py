"""The body of one data-parallel rank for test_data_parallel.py (a module of its own, so a spawned
process can import it). Trains the reference rollouts straight, or with a per-rank checkpoint and a
fresh trainer half way, and writes rank 0's per-step losses and weights."""

from __future__ import annotations

import datetime
import json
import os

ROLLOUTS = 4


def run_rank(rank: int, world_size: int, port: int, hf_dir: str, out_dir: str) -> None:
    """Both runs in one process group: straight (into out_dir/straight) then with a checkpoint half
    way (out_dir/resumed, checkpoint in out_dir/resumed/ckpt)."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=60))
    try:
        for name, checkpoint_dir in (("straight", None), ("resumed", f"{out_dir}/resumed/ckpt")):
            run_dir = f"{out_dir}/{name}"
            os.makedirs(run_dir, exist_ok=True)
            weights, losses = train_reference_rollouts(hf_dir, rank=rank, world_size=world_size, checkpoint_dir=checkpoint_dir)
            if rank == 0:
                torch.save(weights, f"{run_dir}/weights.pt")
                with open(f"{run_dir}/losses.json", "w") as f:
                    json.dump(losses, f)
            with open(f"{run_dir}/rank{rank}_rng.json", "w") as f:
                json.dump(torch.rand(3).tolist(), f)
    finally:
        dist.destroy_process_group()


def make_backend(hf_dir: str, rank: int, world_size: int):
    from backend_fixtures import make_engine_cfg

    from miles.backends.torch import TorchBackend
    from miles.config.algo import AlgoConfig

    cfg = make_engine_cfg(
        hf_dir,
        algo=AlgoConfig(
            eps_clip_high=0.2, use_kl_loss=True, kl_loss_coef=0.1, calculate_per_token_loss=True,
            normalize_advantages=True, entropy_coef=0.01,
        ),
        # 8 samples per prompt, 4 per rank: group statistics are taken on the rollout side, so a rank
        # holding half a group must train (it used to raise "not whole groups").
        micro_batch_size=2, global_batch_size=8, num_steps_per_rollout=1, n_samples_per_prompt=8,
        temperature=0.8, lr=1e-2, weight_decay=0.1, lr_warmup_iters=2,
    )
    return TorchBackend(cfg, rank=rank, world_size=world_size, device="cpu")


def train_reference_rollouts(hf_dir: str, *, rank: int = 0, world_size: int = 1, checkpoint_dir: str | None = None):
    """ROLLOUTS rollouts of 8 samples, one optimizer step each (micro-batch 2), policy + KL + entropy
    loss with whitened advantages. With `checkpoint_dir`, the trainer is saved after half of them and
    a fresh one loads the checkpoint and trains the rest. Returns (weights, per-step losses)."""
    import torch
    from backend_fixtures import make_train_data

    trainer = make_backend(hf_dir, rank, world_size)
    losses = []
    for rollout_id in range(ROLLOUTS):
        if checkpoint_dir and rollout_id == ROLLOUTS // 2:
            trainer.save_checkpoint(checkpoint_dir)
            trainer = make_backend(hf_dir, rank, world_size)
            trainer.load_checkpoint(checkpoint_dir)
        data = make_train_data(8, seed=200 + rollout_id)
        data["rewards"] = [r * (1 + i % 3) for i, r in enumerate(data["rewards"])]  # uneven, so whitening matters
        losses.append(trainer.train_step(data, rollout_id=rollout_id)["train/loss"])
        torch.rand(rank + rollout_id + 1)  # each rank's generator moves differently, as sampling code would
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}, losses
