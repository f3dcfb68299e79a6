"""The SFT warm start of the embedded recipe, through the trainer's own `--loss-type sft_loss` path.

GRPO from random weights learns nothing on a CPU in minutes (every sample gets the same zero reward);
a short supervised pass on prompt → answer pairs brings greedy accuracy to a level where sampled
groups hold both right and wrong answers, which is what GRPO needs. Each step trains on `batch_size`
rows drawn (seeded, with replacement) from `data`, the loss on the answer tokens and `<|eos|>` only.
The result is a Hugging Face directory written atomically (the `.miles-complete` sentinel last);
the held-out accuracy of the warm start is the run's step-0 eval, so this step does not measure it.

It is not a general SFT trainer (no epochs, eval, or checkpoints to resume from): it is a few
seconds of training that a prepare step can redo from scratch when interrupted.

Usage:

    from miles.prepare.sft_warm_start import sft_warm_start
    sft_warm_start(base_model="runs/models/base", data="runs/data/arith/train.jsonl",
                   out_dir="runs/models/sft", steps=375, seed=0)
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from miles.errors import UserError
from miles.prepare import build_once


def _warm_start(kind: str, examples_of, *, base_model: str, data: str, out_dir: str, steps: int, seed: int,
                batch_size: int, lr: float) -> Path:
    """Build (once) an SFT warm start of kind `kind`; `examples_of(tokenizer)` gives its
    (tokens, response length, loss mask) examples from `data`."""
    spec = {
        "kind": kind,
        "base_model": str(Path(base_model).resolve()),
        "data": str(Path(data).resolve()),
        "steps": steps,
        "seed": seed,
        "batch_size": batch_size,
        "lr": lr,
    }

    def build(tmp: Path) -> None:
        import torch
        from transformers import AutoTokenizer

        torch.set_num_threads(1)
        tok = AutoTokenizer.from_pretrained(base_model, local_files_only=True)
        _train(base_model, examples_of(tok), tmp, data=data, steps=steps, seed=seed, batch_size=batch_size, lr=lr)

    return build_once(out_dir, spec, build, what="SFT warm start")


def sft_warm_start(
    *, base_model: str, data: str, out_dir: str, steps: int, seed: int = 0, batch_size: int = 64, lr: float = 1e-3
) -> Path:
    """Train `base_model` for `steps` SFT steps on `data` (JSONL with input/label) and write it to `out_dir`.

    Skipped when `out_dir` is already complete with the same arguments; a complete directory built
    with other arguments raises `UserError`.
    """

    def examples_of(tok) -> list:
        rows = [json.loads(line) for line in Path(data).read_text().splitlines() if line.strip()]
        examples = []
        for row in rows:
            prompt = tok.encode(row["input"], add_special_tokens=False)
            answer = tok.encode(str(row["label"]), add_special_tokens=False) + [tok.eos_token_id]
            examples.append((prompt + answer, len(answer), [1] * len(answer)))
        return examples

    return _warm_start("sft-warm-start", examples_of, base_model=base_model, data=data, out_dir=out_dir, steps=steps,
                       seed=seed, batch_size=batch_size, lr=lr)  # fmt: skip


def sft_conversation_warm_start(
    *, base_model: str, data: str, out_dir: str, steps: int, seed: int = 0, batch_size: int = 64, lr: float = 1e-3
) -> Path:
    """`sft_warm_start` on a JSONL of conversations (`messages`, optional `tools`), as `miles train
    --loss-type sft_loss` reads them: the chat template's tokens, the loss on assistant messages only
    (`miles.rollout.conversation.conversation_ids`)."""

    def examples_of(tok) -> list:
        from miles.rollout.data_source import PromptDataset

        samples = PromptDataset(data, tokenizer=tok, input_key="messages", conversations=True)
        return [(s.tokens, s.response_length, s.loss_mask) for s in samples]

    return _warm_start("sft-conversation-warm-start", examples_of, base_model=base_model, data=data, out_dir=out_dir,
                       steps=steps, seed=seed, batch_size=batch_size, lr=lr)  # fmt: skip


def _train(
    base_model: str, examples: list[tuple[list[int], int, list[int]]], tmp: Path, *, data: str, steps: int, seed: int,
    batch_size: int, lr: float,
) -> None:
    """`steps` sft_loss steps on (tokens, response length, loss mask) examples drawn with replacement;
    the trained weights go to `tmp` as a Hugging Face directory."""
    from miles.backends.torch import TorchBackend
    from miles.train.step import train_rollout
    from miles.ckpt.hf_export import export_hf
    from miles.config.algo import AlgoConfig
    from miles.config.engine import EngineConfig
    from miles.config.optimizer import OptimizerConfig
    from miles.tracking.console import progress

    if not examples:
        raise UserError(f"the SFT data file {data} holds no rows; prepare the task again or point to another file.")
    algo = AlgoConfig(loss_type="sft_loss", calculate_per_token_loss=True)
    opt = OptimizerConfig(lr=lr, lr_decay_style="constant", clip_grad=1.0, seed=seed)
    cfg = EngineConfig(algo=algo, optimizer=opt)
    cfg.rollout.hf_checkpoint = base_model
    cfg.train.micro_batch_size = batch_size
    cfg.train.deterministic_mode = True
    cfg.data.global_batch_size = batch_size
    cfg.data.num_steps_per_rollout = 1
    trainer = TorchBackend(cfg, rank=0, world_size=1, device="cpu")
    rng = random.Random(seed)
    with progress(transient=True) as bar:
        task = bar.add_task("SFT warm start", total=steps)
        for step in range(steps):
            batch = [examples[rng.randrange(len(examples))] for _ in range(batch_size)]
            train_data = {
                "tokens": [t for t, _, _ in batch],
                "response_lengths": [n for _, n, _ in batch],
                "loss_masks": [m for _, _, m in batch],
                "rewards": [0.0] * batch_size,
            }
            train_rollout(trainer, train_data, rollout_id=step)
            bar.advance(task)
    export_hf(dict(trainer.named_weights_for_sync()), base_model, tmp)
