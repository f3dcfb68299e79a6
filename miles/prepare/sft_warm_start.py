"""The SFT warm start of the embedded recipe, through the trainer's own `--loss-type sft_loss` path.

GRPO from random weights learns nothing on a CPU in minutes (every sample gets the same zero reward);
a short supervised pass on prompt → answer pairs brings greedy accuracy to a level where sampled
groups hold both right and wrong answers, which is what GRPO needs. The result is a Hugging Face
directory written atomically (with the `.miles-complete` sentinel last), plus `sft_eval.json` with its
greedy accuracy on the held-out split.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from miles.prepare import build_once


def sft_warm_start(*, base_model: str, data: str, out_dir: str, steps: int, seed: int = 0, batch_size: int = 64, lr: float = 1e-3) -> Path:
    spec = {"kind": "sft-warm-start", "base_model": str(Path(base_model).resolve()), "data": str(Path(data).resolve()), "steps": steps, "seed": seed, "batch_size": batch_size, "lr": lr}

    def build(tmp: Path) -> None:
        import torch
        from transformers import AutoTokenizer

        from miles.backends.torch.trainer import TorchTrainer
        from miles.ckpt.hf_export import export_hf
        from miles.config.algo import AlgoConfig
        from miles.config.optimizer import OptimizerConfig

        torch.set_num_threads(1)
        tok = AutoTokenizer.from_pretrained(base_model, local_files_only=True)
        rows = [json.loads(line) for line in Path(data).read_text().splitlines() if line.strip()]
        examples = []
        for row in rows:
            prompt = tok.encode(row["input"], add_special_tokens=False)
            answer = tok.encode(str(row["label"]), add_special_tokens=False) + [tok.eos_token_id]
            examples.append((prompt + answer, len(answer)))
        algo = AlgoConfig(loss_type="sft_loss", calculate_per_token_loss=True)
        opt = OptimizerConfig(lr=lr, lr_decay_style="constant", clip_grad=1.0, seed=seed)
        trainer = TorchTrainer(base_model, optimizer_cfg=opt, algo_cfg=algo, micro_batch_size=batch_size, deterministic=True, seed=seed)
        rng = random.Random(seed)
        for step in range(steps):
            batch = [examples[rng.randrange(len(examples))] for _ in range(batch_size)]
            train_data = {
                "tokens": [t for t, _ in batch],
                "response_lengths": [n for _, n in batch],
                "loss_masks": [[1] * n for _, n in batch],
                "rewards": [0.0] * batch_size,
            }
            trainer.train_step(train_data, rollout_id=step, global_batch_size=batch_size)
        export_hf(dict(trainer.named_weights_for_sync()), base_model, tmp)

    return build_once(out_dir, spec, build, what="SFT warm start")
