"""GPU-only (2 GPUs, NCCL): the torch backend's reductions on device tensors (skipped without them;
`scripts/gpu_smoke.sh` runs them). Two spawned ranks, one GPU each:

- the helpers and the trainer's metric reduction give the hand-computed sums, maxima and minima
  (rank r reports loss r + 1, `_max` 10 r, `_min` -r), a CPU statistic reduced in place travels to the
  GPU and back;
- DDP on two GPUs trains the tiny model for two rollouts: finite metrics, equal on both ranks, and the
  same weights on both (a checksum over the engines' buckets).

Unverified on the CPU-only build machine: these have never run there."""

from __future__ import annotations

import datetime
import json
import math
import os

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")]


def _rank(rank: int, port: int, hf_dir: str, out_dir: str, device: str = "cuda") -> None:
    """One rank; `device="cpu"` runs the same body over gloo (how it was checked without GPUs)."""
    import torch.distributed as dist

    if device == "cuda":
        torch.cuda.set_device(rank)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("nccl" if device == "cuda" else "gloo", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=120))
    try:
        from backend_fixtures import make_engine_cfg, make_train_data

        from miles.backends import collectives
        from miles.backends.torch import TorchBackend
        from miles.backends.torch.trainer import _all_reduce_metrics
        from miles.train.step import train_rollout

        out: dict = {"group_device": str(collectives.group_device())}
        out["metrics"] = _all_reduce_metrics({"train/loss": rank + 1.0, "train/x_max": 10.0 * rank, "train/x_min": -float(rank)})
        cpu_stat = torch.tensor([1.0, rank + 0.5], dtype=torch.float64)
        collectives.all_reduce_(cpu_stat)
        out["cpu_stat"] = [cpu_stat.device.type, cpu_stat.tolist()]
        cfg = make_engine_cfg(hf_dir, micro_batch_size=2, global_batch_size=8)
        trainer = TorchBackend(cfg, rank=rank, world_size=2, device=device)
        out["train"] = [train_rollout(trainer, make_train_data(8, seed=s), rollout_id=s) for s in range(2)]
        out["checksum"] = trainer.weights_checksum()
        with open(f"{out_dir}/rank{rank}.json", "w") as f:
            json.dump(out, f)
    finally:
        dist.destroy_process_group()


def test_nccl_metric_reductions_and_ddp_on_two_gpus(tiny_hf_dir, tmp_path):
    import multiprocessing

    from miles.utils.net import free_port

    ctx = multiprocessing.get_context("spawn")
    port = free_port("127.0.0.1")
    procs = [ctx.Process(target=_rank, args=(r, port, tiny_hf_dir, str(tmp_path))) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=300)
        if p.is_alive():
            p.kill()
    assert [p.exitcode for p in procs] == [0, 0]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["group_device"] for r in ranks] == ["cuda:0", "cuda:1"]
    for r in ranks:
        assert r["metrics"] == {"train/loss": 3.0, "train/x_max": 10.0, "train/x_min": -1.0}
        assert r["cpu_stat"] == ["cpu", [2.0, 2.0]]
    assert ranks[0]["train"] == ranks[1]["train"]
    assert all(math.isfinite(v) for m in ranks[0]["train"] for v in m.values())
    assert ranks[0]["checksum"] == ranks[1]["checksum"]
