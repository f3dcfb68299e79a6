"""The learning-rate schedule: `lr_at(step, cfg)`, a pure function of the optimizer-step index.

The schedule's whole state is one integer (`TrainerBackend.num_optimizer_steps`, saved with every
checkpoint), so a resume reproduces it exactly, on every backend alike. It is not a
`torch.optim.lr_scheduler`: those pickle closures in their state and re-derive the lr
multiplicatively, which drifts in the last bits. The RL step computes the lr of each step here and
hands it to `TrainerBackend.optimizer_step(lr)`.
"""

from __future__ import annotations

import math

from miles.config.optimizer import OptimizerConfig
from miles.errors import UserError


def lr_at(step: int, cfg: OptimizerConfig) -> float:
    """The learning rate of optimizer step `step` (0-based: the first step of the run is step 0).

    Warmup: step k < lr_warmup_iters uses lr * (k + 1) / lr_warmup_iters, so no step runs at lr 0.
    Decay: from the end of the warmup to `lr_decay_iters`, progress p in [0, 1] moves the lr from `lr`
    to `min_lr` (linear: lr - (lr - min_lr) * p; cosine: min_lr + (lr - min_lr) * (1 + cos(pi p)) / 2).
    """
    warmup = cfg.lr_warmup_iters
    if step < warmup:
        return cfg.lr * (step + 1) / warmup
    if cfg.lr_decay_style == "constant":
        return cfg.lr
    if cfg.lr_decay_iters is None:
        raise UserError(
            f"--lr-decay-style {cfg.lr_decay_style} needs --lr-decay-iters (the step where the lr reaches --min-lr).",
            option="--lr-decay-iters",
        )
    decay_steps = cfg.lr_decay_iters - warmup
    progress = 1.0 if decay_steps <= 0 else min(1.0, (step - warmup) / decay_steps)
    if cfg.lr_decay_style == "linear":
        return cfg.lr - (cfg.lr - cfg.min_lr) * progress
    if cfg.lr_decay_style == "cosine":
        return cfg.min_lr + (cfg.lr - cfg.min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))
    raise UserError(
        f"--lr-decay-style {cfg.lr_decay_style!r} is not one of constant, linear, cosine.",
        option="--lr-decay-style",
    )
