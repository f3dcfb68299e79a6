"""Spawned gloo worker processes running `MegatronTrainer` for the megatron tests.

`run(world, job, out_dir, timeout)` starts `world` processes (torch.multiprocessing spawn, a free
port, one torch thread each); every rank builds the trainer from `job["config"]` (option values by
field name), optionally loads a checkpoint, trains on the rollouts `job["rollouts"]` (seeds for
`reference.make_train_data`), optionally saves a checkpoint after rollout `job["save_after"]`,
and rank 0 writes `result.pt` (with `job["offload_each_rollout"]` the trainer's storages are released
and restored after every rollout, the bytes held before, released, and held after): the metrics of every rollout, the weights checksum, the HF tensors
from `iter_weight_buckets` and (with `job["export_hf"]`) an HF export of the same weights.
"""

from __future__ import annotations

import os
import sys
import time
import warnings
from pathlib import Path

import torch

from miles.utils.net import free_port as _net_free_port

sys.path.insert(0, str(Path(__file__).parent))


def free_port() -> int:
    return _net_free_port("127.0.0.1")


def _worker(rank: int, world: int, port: int, job: dict, out_dir: str) -> None:
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    from datetime import timedelta

    import torch.distributed as dist

    from _mg_reference import make_train_data

    device = job.get("device", "cpu")  # "cuda": NCCL, one GPU per rank (the GPU-only tests)
    if device == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if device == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=120))
    from miles.backends.megatron.trainer import MegatronTrainer
    from miles.train.step import train_rollout
    from miles.config.resolve import build_config, fill_derived

    cfg = build_config(job["config"])
    fill_derived(cfg)
    trainer = MegatronTrainer(cfg, rank=rank, world_size=world, device=device)
    trainer.layout = job.get("layout")  # None: the cheaper layout per micro-batch
    if job.get("load"):
        trainer.load_checkpoint(job["load"])
    result: dict = {"metrics": []}

    def log_probs():
        from miles.backends.megatron.model import _unwrap
        from miles.train.packing import pack_samples

        data = make_train_data(4, seed=job["log_probs_seed"], vocab=job.get("vocab", 19))
        # the width of the logits the model hands back on this rank (its vocabulary slice under TP)
        hook = _unwrap(trainer.model).register_forward_hook(lambda m, i, out: result.__setitem__("logits_width", out.shape[-1]))
        lp, ent = trainer.compute_log_probs(pack_samples(data, range(4), device), with_entropy=True)
        hook.remove()
        return lp.cpu(), ent.cpu()

    if job.get("log_probs_seed") is not None:
        result["initial_log_probs"], result["initial_entropy"] = log_probs()
    for k, seed in enumerate(job["rollouts"]):
        data = make_train_data(job.get("samples", 8), seed=seed, vocab=job.get("vocab", 19))
        result["metrics"].append(train_rollout(trainer, data, rollout_id=k,
                                               reuse_on_policy_log_probs=job.get("reuse_on_policy_log_probs", True)))
        if job.get("offload_each_rollout"):  # what --offload-train does on a GPU, here on the CPU's storages
            held = _held_bytes(trainer)
            allocated = torch.cuda.memory_allocated() if device == "cuda" else 0
            freed = trainer.offload_to_host(device)
            offloaded = torch.cuda.memory_allocated() if device == "cuda" else 0
            result.setdefault("offload", []).append((held, freed, _held_bytes(trainer)))
            result.setdefault("cuda_allocated", []).append((allocated, offloaded))
            trainer.onload()
        if job.get("save_after") == k:
            os.makedirs(job["save"], exist_ok=True)
            trainer.save_checkpoint(job["save"])
    if job.get("log_probs_seed") is not None:
        result["log_probs"], result["entropy"] = log_probs()
    result["checksum"] = trainer.weights_checksum()
    result["dtypes"] = _dtypes(trainer)
    result["num_params"] = sum(p.numel() for p in trainer.model.parameters())
    result["devices"] = sorted({p.device.type for p in trainer.model.parameters()})
    buckets = list(trainer.iter_weight_buckets(job.get("bucket_bytes", 64 * 1024)))
    result["num_buckets"] = len(buckets)
    result["bucket_devices"] = sorted({t.device.type for b in buckets for _, t in b})
    result["bucket_tensors"] = [(n, t.cpu().clone()) for b in buckets for n, t in b]
    if job.get("export_hf") and trainer.is_weight_source:
        from miles.ckpt.hf_export import export_hf

        export_hf(dict(result["bucket_tensors"]), cfg.rollout.hf_checkpoint, job["export_hf"])
    gathered = [None] * world
    dist.all_gather_object(gathered, (result["checksum"], len(buckets), sum(len(b) for b in buckets)))
    result["per_rank"] = gathered
    if rank == 0:
        torch.save(result, os.path.join(out_dir, "result.pt"))
    dist.barrier()
    dist.destroy_process_group()


def _held_bytes(trainer) -> int:
    """Bytes of the distinct storages behind parameters, gradient buffers and optimizer state."""
    from miles.backends.megatron.checkpoint import _inner_optimizers

    tensors = list(trainer.model.parameters()) + [b.grad_data for b in trainer.model.buffers]
    for opt in _inner_optimizers(trainer):
        tensors += [p for g in opt.optimizer.param_groups for p in g["params"]]
        tensors += [v for st in opt.optimizer.state.values() for v in st.values() if torch.is_tensor(v)]
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())


def _dtypes(trainer) -> dict:
    """The dtypes a rank holds: model parameters, the gradient buffers, the optimizer's main
    parameters (the fp32 copies under --bf16) and its Adam moments."""
    from miles.backends.megatron.checkpoint import _inner_optimizers

    out = {"params": {str(p.dtype) for p in trainer.model.parameters()},
           "grads": {str(p.main_grad.dtype) for p in trainer.model.parameters() if getattr(p, "main_grad", None) is not None},
           "main_params": set(), "adam": set()}
    for opt in _inner_optimizers(trainer):
        inner = opt.optimizer
        out["main_params"] |= {str(p.dtype) for g in inner.param_groups for p in g["params"]}
        out["adam"] |= {str(v.dtype) for st in inner.state.values() for k, v in st.items() if k.startswith("exp_avg")}
    return out


def run(world: int, job: dict, out_dir: Path, timeout: float = 300) -> dict:
    """Spawn `world` ranks; rank 0's result dict; raise if they do not all finish within `timeout` s."""
    import torch.multiprocessing as mp

    ctx = mp.start_processes(_worker, args=(world, free_port(), job, str(out_dir)), nprocs=world, join=False,
                             start_method="spawn")
    deadline = time.monotonic() + timeout
    while not ctx.join(timeout=max(0.1, deadline - time.monotonic())):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            raise TimeoutError(f"{world} megatron training rank(s) did not finish {job['rollouts']} within {timeout} s")
    return torch.load(Path(out_dir) / "result.pt", weights_only=False)
