"""Benchmark: peak memory and step time of a LoRA train step vs full fine-tuning, same model, same batch, same run.

Both sides are `miles.train.step.train_rollout` on `TorchBackend` (GRPO policy loss, one optimizer step
per rollout), on the 15M-parameter bench model (hidden 384, 8 layers, 6 heads / 2 kv heads, MLP 1024,
vocab 8192, as bench/rollout_engine.py) and one batch of 16 x 128 tokens (96 response). LoRA: rank 8,
alpha 16, all-linear (q/k/v/o, gate/up/down); the embeddings and the LM head stay frozen, as upstream.

Each measurement is a fresh interpreter (`--child`), so its peak resident memory is its own: the
parent alternates full and LoRA children for `--rounds` rounds (a load change on a shared machine hits
both alike) and reports medians. Per child: RSS once the trainer is built (weights loaded), the peak
RSS over the timed steps (`ru_maxrss`), and their difference, the memory training adds (gradients,
optimizer state, activations); the median step time after one warm-up step; the trainable
parameters and AdamW's state bytes (`TorchBackend.parameter_metrics`).

What it is not: a GPU number. On a GPU the activations dominate at long sequences, and LoRA saves the
weights' gradients and optimizer state, not the activations.

Run (about 2-4 minutes on 2 busy cores):

    python bench/lora.py
    python bench/lora.py --rounds 3 --steps 8
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
MODEL_15M = dict(hidden=384, layers=8, heads=6, kv_heads=2, mlp=1024, vocab=8192)
MODEL_TINY = dict(hidden=64, layers=1, heads=2, kv_heads=1, mlp=128, vocab=256)


def make_model_dir(path: str, m: dict) -> None:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(
        vocab_size=m["vocab"], hidden_size=m["hidden"], intermediate_size=m["mlp"], num_hidden_layers=m["layers"],
        num_attention_heads=m["heads"], num_key_value_heads=m["kv_heads"], head_dim=m["hidden"] // m["heads"],
        max_position_embeddings=1024, tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    Qwen3ForCausalLM(cfg).save_pretrained(path)


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def child(args) -> None:
    import random

    import torch

    from miles.backends.torch import TorchBackend
    from miles.config.algo import AlgoConfig
    from miles.config.engine import EngineConfig
    from miles.config.optimizer import OptimizerConfig
    from miles.train.step import train_rollout

    torch.set_num_threads(args.threads)
    cfg = EngineConfig()
    cfg.rollout.hf_checkpoint = args.model_dir
    cfg.train.micro_batch_size = args.batch
    cfg.data.num_steps_per_rollout = 1
    cfg.data.global_batch_size = args.batch
    cfg.optimizer = OptimizerConfig(lr=1e-4, seed=0)
    cfg.algo = AlgoConfig(eps_clip_high=0.2)
    if args.child == "lora":
        cfg.lora.lora_rank, cfg.lora.lora_alpha, cfg.lora.target_modules = 8, 16, ["all-linear"]
    trainer = TorchBackend(cfg, rank=0, world_size=1, device="cpu")
    rng = random.Random(0)
    vocab = trainer.model.config.vocab_size
    data = {
        "tokens": [[rng.randrange(vocab) for _ in range(args.seq)] for _ in range(args.batch)],
        "response_lengths": [args.response] * args.batch,
        "rewards": [rng.choice([-1.0, 1.0]) for _ in range(args.batch)],
        "loss_masks": [[1] * args.response for _ in range(args.batch)],
    }
    built = rss_bytes()
    times = []
    for step in range(args.steps + 1):
        t0 = time.perf_counter()
        train_rollout(trainer, data, rollout_id=step)
        if step:  # step 0 pays one-off allocations (AdamW's state, autograd buffers)
            times.append(time.perf_counter() - t0)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    params = trainer.parameter_metrics()
    print(json.dumps({"built_rss": built, "peak_rss": peak, "step_s": statistics.median(times), **params}))


def run_child(which: str, model_dir: str, args) -> dict:
    cmd = [sys.executable, str(HERE / "lora.py"), "--child", which, "--model-dir", model_dir, "--steps", str(args.steps),
           "--threads", str(args.threads), "--batch", str(args.batch), "--seq", str(args.seq), "--response", str(args.response)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout_s)
    if r.returncode != 0:
        raise SystemExit(f"bench/lora.py --child {which} failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def mib(n: float) -> str:
    return f"{n / 2**20:.1f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2, help="full/LoRA child pairs (medians over them)")
    ap.add_argument("--steps", type=int, default=5, help="timed steps per child, after one warm-up step")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=128, help="tokens per sample (prompt + response)")
    ap.add_argument("--response", type=int, default=96)
    ap.add_argument("--tiny", action="store_true", help="a tiny model and batch, one round of one step (the smoke test)")
    ap.add_argument("--json", default=None, help="also write the rows here (bench/run_all.py reads it)")
    ap.add_argument("--timeout-s", type=float, default=900.0, help="kill a child after this long")
    ap.add_argument("--child", choices=["full", "lora"], default=None, help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args)
    model = MODEL_15M
    if args.tiny:
        model, args.rounds, args.steps, args.batch, args.seq, args.response = MODEL_TINY, 1, 1, 4, 16, 8
    results: dict[str, list[dict]] = {"full": [], "lora": []}
    with tempfile.TemporaryDirectory() as model_dir:
        make_model_dir(model_dir, model)
        for _ in range(args.rounds):
            for which in ("full", "lora"):
                results[which].append(run_child(which, model_dir, args))
    med = {w: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for w, rs in results.items()}
    f, lo = med["full"], med["lora"]
    print(f"model: {model}; batch {args.batch} x {args.seq} tokens ({args.response} response); {args.threads} thread(s); "
          f"median of {args.rounds} round(s) x {args.steps} step(s); load average {os.getloadavg()[0]:.1f}")
    print(f"{'':22s} {'trainable':>11s} {'share':>7s} {'optim MiB':>10s} {'built MiB':>10s} {'peak MiB':>9s} {'train adds MiB':>15s} {'step s':>8s}")
    for name, m in (("full fine-tuning", f), ("LoRA r8 all-linear", lo)):
        print(f"{name:22s} {int(m['train/trainable_params']):>11,d} {100 * m['train/trainable_share']:6.2f}% "
              f"{mib(m['train/optimizer_state_bytes']):>10s} {mib(m['built_rss']):>10s} {mib(m['peak_rss']):>9s} "
              f"{mib(m['peak_rss'] - m['built_rss']):>15s} {m['step_s']:8.3f}")
    peak_ratio = lo["peak_rss"] / f["peak_rss"]
    adds_ratio = (lo["peak_rss"] - lo["built_rss"]) / max(1.0, f["peak_rss"] - f["built_rss"])
    time_ratio = f["step_s"] / lo["step_s"]
    print(f"LoRA / full: peak memory {peak_ratio:.2f}x, memory training adds {adds_ratio:.2f}x; full / LoRA step time {time_ratio:.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps({"bench": "lora", "rows": [
            {"what": "LoRA r8 vs full fine-tuning: peak RSS (15M model)", "value": peak_ratio, "unit": "x full", "goal": "< 1", "met": peak_ratio < 1},
            {"what": "LoRA r8 vs full fine-tuning: memory training adds", "value": adds_ratio, "unit": "x full", "goal": "< 1", "met": adds_ratio < 1},
            {"what": "LoRA r8 vs full fine-tuning: step speed", "value": time_ratio, "unit": "x full", "goal": "", "met": None},
        ]}, indent=2))


if __name__ == "__main__":
    main()
