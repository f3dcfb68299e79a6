"""The body of one data-parallel rank for test_data_parallel.py and test_fsdp.py (a module of its own,
so a spawned process can import it). Trains the reference rollouts straight, or with a per-rank
checkpoint and a fresh trainer half way, with `--train-backend` torch (DDP) or fsdp (FSDP2), and
writes rank 0's per-step losses, grad norms and weights; with `buckets`, also what every rank's
weight-bucket iteration produced and an HF export of the straight run's final weights gathered by
torch's own full state dict (an independent path)."""

from __future__ import annotations

import datetime
import json
import os

ROLLOUTS = 4
WAIT_S = 180


def spawn(world_size: int, hf_dir: str, out_dir: str, **kwargs) -> None:
    """Run `run_rank` on `world_size` spawned processes (one gloo group) and wait for all of them."""
    import multiprocessing
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=run_rank, args=(r, world_size, port, hf_dir, out_dir), kwargs=kwargs) for r in range(world_size)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=WAIT_S)
    alive = [p for p in procs if p.is_alive()]
    for p in alive:
        p.kill()
    assert not alive, f"data-parallel ranks still running after {WAIT_S}s (gloo collective hung?)"
    assert [p.exitcode for p in procs] == [0] * world_size, "a data-parallel rank failed; see its traceback above"


def run_rank(rank: int, world_size: int, port: int, hf_dir: str, out_dir: str, train_backend: str = "torch",
             buckets: bool = False, max_tokens_per_gpu: int | None = None, resume: bool = True) -> None:
    """Both runs in one process group: straight (into out_dir/straight) then, with `resume`, with a
    checkpoint half way (out_dir/resumed, checkpoint in out_dir/resumed/ckpt). `max_tokens_per_gpu`:
    token-budget micro-batches (--use-dynamic-batch-size) instead of 2 samples each."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=60))
    try:
        runs = (("straight", None), ("resumed", f"{out_dir}/resumed/ckpt"))
        for name, checkpoint_dir in runs if resume else runs[:1]:
            run_dir = f"{out_dir}/{name}"
            os.makedirs(run_dir, exist_ok=True)
            trainer, losses, norms = train_reference_rollouts(
                hf_dir, rank=rank, world_size=world_size, checkpoint_dir=checkpoint_dir, train_backend=train_backend,
                max_tokens_per_gpu=max_tokens_per_gpu,
            )
            weights = full_weights(trainer)  # a collective under FSDP: every rank
            if rank == 0:
                torch.save(weights, f"{run_dir}/weights.pt")
                with open(f"{run_dir}/losses.json", "w") as f:
                    json.dump(losses, f)
                with open(f"{run_dir}/grad_norms.json", "w") as f:
                    json.dump(norms, f)
            if buckets and name == "straight":
                write_buckets_and_export(trainer, hf_dir, rank, run_dir)
            with open(f"{run_dir}/rank{rank}_rng.json", "w") as f:
                json.dump(torch.rand(3).tolist(), f)
    finally:
        dist.destroy_process_group()


def full_weights(trainer) -> dict:
    """HF name -> full tensor copy, every parameter (tied ones under each name), from the trainer's
    model state dict; sharded parameters are gathered."""
    from miles.backends.torch.fsdp import full_tensor

    return {k: full_tensor(v.detach()).clone() for k, v in trainer.model.state_dict(keep_vars=True).items()}


def write_buckets_and_export(trainer, hf_dir: str, rank: int, run_dir: str) -> None:
    """Every rank: its bucket count and tensor count from `iter_weight_buckets`; rank 0 also the
    buckets' tensors and an HF export of torch's full state dict (gathered to rank 0 by
    `get_model_state_dict(full_state_dict=True)`, not by the trainer's own gather)."""
    import torch
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from miles.ckpt.hf_export import export_hf

    buckets = list(trainer.iter_weight_buckets(20_000))
    with open(f"{run_dir}/buckets_rank{rank}.json", "w") as f:
        json.dump({"num_buckets": len(buckets), "num_tensors": sum(len(b) for b in buckets)}, f)
    full = get_model_state_dict(trainer.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        torch.save({name: t.clone() for b in buckets for name, t in b}, f"{run_dir}/bucket_tensors.pt")
        with open(f"{run_dir}/checksum.json", "w") as f:
            json.dump(trainer.weights_checksum(), f)
        export_hf(full, hf_dir, f"{run_dir}/export")
    else:
        trainer.weights_checksum()  # a collective too


def make_backend(hf_dir: str, rank: int, world_size: int, train_backend: str = "torch", max_tokens_per_gpu: int | None = None):
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
    cfg.train.train_backend = train_backend
    cfg.train.use_dynamic_batch_size = max_tokens_per_gpu is not None
    cfg.train.max_tokens_per_gpu = max_tokens_per_gpu
    return TorchBackend(cfg, rank=rank, world_size=world_size, device="cpu")


def train_reference_rollouts(
    hf_dir: str, *, rank: int = 0, world_size: int = 1, checkpoint_dir: str | None = None, train_backend: str = "torch",
    max_tokens_per_gpu: int | None = None,
):
    """ROLLOUTS rollouts of 8 samples, one optimizer step each (micro-batch 2), policy + KL + entropy
    loss with whitened advantages. With `checkpoint_dir`, the trainer is saved after half of them and
    a fresh one loads the checkpoint and trains the rest. Returns (trainer, per-step losses, grad norms)."""
    import torch
    from backend_fixtures import make_train_data

    from miles.train.step import train_rollout

    trainer = make_backend(hf_dir, rank, world_size, train_backend, max_tokens_per_gpu)
    losses, norms = [], []
    for rollout_id in range(ROLLOUTS):
        if checkpoint_dir and rollout_id == ROLLOUTS // 2:
            trainer.save_checkpoint(checkpoint_dir)
            trainer = make_backend(hf_dir, rank, world_size, train_backend, max_tokens_per_gpu)
            trainer.load_checkpoint(checkpoint_dir)
        data = make_train_data(8, seed=200 + rollout_id)
        data["rewards"] = [r * (1 + i % 3) for i, r in enumerate(data["rewards"])]  # uneven, so whitening matters
        metrics = train_rollout(trainer, data, rollout_id=rollout_id)
        losses.append(metrics["train/loss"])
        norms.append(metrics["train/grad_norm"])
        torch.rand(rank + rollout_id + 1)  # each rank's generator moves differently, as sampling code would
    return trainer, losses, norms
