"""Benchmark: `miles.train.step.train_rollout` on `TorchBackend` (packed batch, vectorised loss) against a hand-written HF loop.

Baseline (measured in the same run, same model, same batch, same attention kernel "eager", same
thread count): right-pad the batch, one forward of `AutoModelForCausalLM`, cross-entropy over the
response tokens, backward, clip the grad norm, `torch.optim.AdamW.step()`. That is the least work
any trainer can do per step, so the ratio is our overhead:

- `sft_loss` does the same work as the baseline, minus the LM head on prompt positions (the trainer
  projects only the positions that predict response tokens) and with fused AdamW;
- `policy_loss` (GRPO, one optimizer step per rollout, so the training forward's log-probs are the
  old log-probs) adds the entropy of every response position (a reported metric).

A second baseline row uses fused AdamW too, to separate the optimizer's share of the difference.
A last row runs the `sft_loss` step with `--bf16` (autocast bf16 matmuls, fp32 master weights): its
tokens/s over the fp32 row is the bf16/fp32 ratio on this machine (on a CPU without bf16 matrix
units it can be below 1; on GPUs bf16 is the fast path).

Throughput counts every token of the batch (prompt + response) per second of train step.

Run (about a minute on a 2-core CPU):

    python bench/train_step.py                      # hidden 256, 4 layers, vocab 8192, 16 x 128 tokens
    python bench/train_step.py --micro-batch-size 4 --threads 2
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time


def make_model_dir(path: str, *, hidden: int, layers: int, vocab: int) -> None:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    heads = max(1, hidden // 64)
    cfg = Qwen3Config(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=heads, head_dim=hidden // heads,
        max_position_embeddings=1024, tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    Qwen3ForCausalLM(cfg).save_pretrained(path)


def make_batch(n: int, seq: int, vocab: int, response: int) -> dict:
    rng = random.Random(0)
    tokens = [[rng.randrange(vocab) for _ in range(seq)] for _ in range(n)]
    return {
        "tokens": tokens,
        "response_lengths": [response] * n,
        "rewards": [rng.choice([-1.0, 1.0]) for _ in range(n)],
        "loss_masks": [[1] * response for _ in range(n)],
    }


def baseline_step_fn(hf_dir: str, data: dict, lr: float, fused: bool = False):
    """One step of the plain loop, as a closure (the model and optimizer live inside it)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager").train()
    opt = torch.optim.AdamW(
        model.parameters(), lr=lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0, **({"fused": True} if fused else {"foreach": False})
    )
    ids = torch.tensor(data["tokens"])
    r = data["response_lengths"][0]

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        logits = model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False).logits
        pred = logits[:, -r - 1 : -1].float()
        loss = torch.nn.functional.cross_entropy(pred.reshape(-1, pred.shape[-1]), ids[:, -r:].reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()

    return step


def trainer_step_fn(hf_dir: str, data: dict, lr: float, loss_type: str, micro_batch_size: int, bf16: bool = False):
    from miles.backends.torch import TorchBackend
    from miles.train.step import train_rollout
    from miles.config.algo import AlgoConfig
    from miles.config.engine import EngineConfig
    from miles.config.optimizer import OptimizerConfig

    cfg = EngineConfig()
    cfg.rollout.hf_checkpoint = hf_dir
    cfg.train.micro_batch_size = micro_batch_size
    cfg.train.bf16 = bf16
    cfg.data.num_steps_per_rollout = 1
    cfg.optimizer = OptimizerConfig(lr=lr, seed=0)
    cfg.algo = AlgoConfig(loss_type=loss_type, eps_clip_high=0.2)
    trainer = TorchBackend(cfg, rank=0, world_size=1, device="cpu")
    return lambda: train_rollout(trainer, data, rollout_id=0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=128, help="tokens per sample (prompt + response)")
    ap.add_argument("--response", type=int, default=96, help="response tokens per sample")
    ap.add_argument("--micro-batch-size", type=int, default=None, help="default: the whole batch, as the baseline")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--tiny", action="store_true", help="a tiny model and batch, one step (the smoke test)")
    ap.add_argument("--json", default=None, help="also write the goal rows here (bench/run_all.py reads it)")
    args = ap.parse_args()
    if args.tiny:
        args.hidden, args.layers, args.vocab, args.batch, args.seq, args.response, args.steps = 64, 1, 256, 4, 16, 8, 1

    import torch

    torch.set_num_threads(args.threads)
    data = make_batch(args.batch, args.seq, args.vocab, args.response)
    tokens = args.batch * args.seq
    mbs = args.micro_batch_size or args.batch
    with tempfile.TemporaryDirectory() as hf_dir:
        make_model_dir(hf_dir, hidden=args.hidden, layers=args.layers, vocab=args.vocab)
        runners = {
            "plain HF loop (baseline)": baseline_step_fn(hf_dir, data, 1e-4),
            # The trainer uses fused AdamW; this row shows how much of its lead is the optimizer alone.
            "plain HF loop, fused AdamW": baseline_step_fn(hf_dir, data, 1e-4, fused=True),
        }
        for loss_type in ("sft_loss", "policy_loss"):
            runners[f"TorchBackend {loss_type}, micro-batch {mbs}"] = trainer_step_fn(hf_dir, data, 1e-4, loss_type, mbs)
        runners[f"TorchBackend sft_loss, micro-batch {mbs}, --bf16"] = trainer_step_fn(hf_dir, data, 1e-4, "sft_loss", mbs, bf16=True)
        times: dict[str, list[float]] = {name: [] for name in runners}
        # Interleaved rounds: a load change on a shared machine hits every contender alike.
        for round_ in range(args.steps + 1):
            for name, step in runners.items():
                t0 = time.perf_counter()
                step()
                if round_:  # round 0 pays one-off allocation costs
                    times[name].append(time.perf_counter() - t0)
    rows = [(name, statistics.median(t)) for name, t in times.items()]
    base = rows[0][1]

    print(
        f"model: hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}; batch {args.batch} x {args.seq} "
        f"tokens ({args.response} response); {args.threads} thread(s); median of {args.steps} interleaved steps"
    )
    print(f"{'':44s} {'step s':>8s} {'tokens/s':>10s} {'vs baseline':>12s}")
    for name, t in rows:
        print(f"{name:44s} {t:8.3f} {tokens / t:10.0f} {base / t:11.2f}x")
    if args.json:
        import json
        from pathlib import Path

        sft, pol, sft16 = (rows[2][1], rows[3][1], rows[4][1])  # step seconds, in the order of `runners`
        Path(args.json).write_text(json.dumps({"bench": "train_step", "rows": [
            {"what": "train step (sft_loss) vs plain HF loop", "value": base / sft, "unit": "x HF loop", "goal": ">= 1", "met": base / sft >= 1},
            {"what": "train step (policy_loss, + old log-probs) vs HF loop", "value": base / pol, "unit": "x HF loop", "goal": "", "met": None},
            {"what": "train step tokens/s, --bf16 / fp32 (sft_loss, this CPU)", "value": sft / sft16, "unit": "x fp32", "goal": "", "met": None},
        ]}, indent=2))


if __name__ == "__main__":
    main()
