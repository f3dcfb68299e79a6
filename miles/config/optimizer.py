"""Optimizer options (`cfg.optimizer`): AdamW hyper-parameters, the LR schedule, gradient clipping, seed.

Flag names and defaults match upstream miles (`--lr 1e-6`, `--clip-grad 1.0`, `--seed 1234`, ...).
This module only declares the options; the torch backend turns them into an optimizer and an LR
schedule (`miles/backends/torch/optim.py`). It imports nothing heavy, so `miles --help` reads it.

LR schedule (the step index counts optimizer steps, not rollouts): a linear warmup over
`lr_warmup_iters` steps, then `lr_decay_style` from `lr` to `min_lr` over the steps up to
`lr_decay_iters`, then `min_lr`. `constant` stays at `lr` after warmup.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from miles.config.fields import Derived, option
from miles.config.trainer_support import not_yet


@dataclasses.dataclass
class OptimizerConfig:
    """AdamW and its learning-rate schedule, one field per flag (`--lr`, `--adam-beta1`, ...)."""

    optimizer: Literal["adam"] = option(
        "adam", help="Optimizer. Only adam (AdamW: decoupled weight decay) is available."
    )
    lr: float = option(1e-6, help="Peak learning rate, reached at the end of the warmup.")
    min_lr: float = option(0.0, help="Learning rate at the end of the decay (linear and cosine styles).")
    lr_decay_style: Literal["constant", "linear", "cosine"] = option(
        "constant", help="How the learning rate goes from --lr to --min-lr after the warmup."
    )
    lr_warmup_iters: int = option(
        0, help="Optimizer steps of linear warmup from 0 to --lr (step k of the warmup uses lr*(k+1)/iters)."
    )
    lr_decay_iters: int | None = option(
        help="Optimizer step at which the decay reaches --min-lr (warmup steps included).",
        derived=Derived(
            "the run's total optimizer steps (--num-rollout × --num-steps-per-rollout)",
            # Unknown (None) until --num-rollout is known: with --num-epoch the driver sets it from the
            # dataset size and resolves again.
            lambda c: None if c.data.num_rollout is None else c.data.num_rollout * c.data.num_steps_per_rollout,
        ),
    )
    weight_decay: float = option(
        0.0, help="Decoupled (AdamW) weight decay; not applied to 1-D parameters (norms, biases)."
    )
    adam_beta1: float = option(0.9, help="Adam beta1 (first-moment decay).")
    adam_beta2: float = option(0.95, help="Adam beta2 (second-moment decay).")
    adam_eps: float = option(1e-8, help="Adam epsilon added to the denominator.")
    clip_grad: float = option(1.0, help="Clip the global gradient L2 norm to this value; 0 disables clipping.")
    optimizer_cpu_offload: bool = option(
        False,
        help="Megatron: keep the optimizer state and its step on the host (the GPU holds only bf16 weights and "
        "gradients)." + not_yet("optimizer_cpu_offload"),
    )
    seed: int = option(1234, help="Seed of the trainer's torch, numpy and python RNGs.")
