"""AdamW and the learning-rate schedule built from `OptimizerConfig`.

`lr_at(step, cfg)` is the whole schedule as a pure function of the optimizer-step index, so the
schedule's state is one integer (`LRSchedule.num_steps`) and a resume reproduces it exactly. It is not
a `torch.optim.lr_scheduler` subclass: those pickle closures in their state and re-derive the lr
multiplicatively, which drifts in the last bits.

Use: `opt = build_optimizer(model, cfg)`; `sched = LRSchedule(opt, cfg)`; before each `opt.step()`
call `sched.apply()`, after it `sched.advance()`.
"""

from __future__ import annotations

import math
from typing import Any

import torch

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


def build_optimizer(model: torch.nn.Module, cfg: OptimizerConfig) -> torch.optim.AdamW:
    """AdamW over the trainable parameters; 1-D parameters (norm weights, biases) get no weight decay,
    as in Megatron, because decaying a norm's gain towards 0 only hurts."""
    if cfg.optimizer != "adam":
        raise UserError(f"--optimizer {cfg.optimizer!r} is not available; use adam.", option="--optimizer")
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (no_decay if p.ndim < 2 else decay).append(p)
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    # fused: one kernel per parameter for the whole update (about 4x faster than the per-op path on
    # CPU, see bench/train_step.py); elementwise, so still bit-reproducible run to run.
    return torch.optim.AdamW(
        [g for g in groups if g["params"]],
        lr=lr_at(0, cfg),
        betas=(cfg.adam_beta1, cfg.adam_beta2),
        eps=cfg.adam_eps,
        fused=True,
    )


class LRSchedule:
    """Sets the optimizer's lr from `lr_at(num_steps)`; its state is the number of steps taken."""

    def __init__(self, optimizer: torch.optim.Optimizer, cfg: OptimizerConfig):
        self.optimizer = optimizer
        self.cfg = cfg
        self.num_steps = 0

    def current_lr(self) -> float:
        return lr_at(self.num_steps, self.cfg)

    def apply(self) -> float:
        """Write the lr of the coming step into every param group and return it."""
        lr = self.current_lr()
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        return lr

    def advance(self) -> None:
        self.num_steps += 1

    def state_dict(self) -> dict[str, Any]:
        return {"num_steps": self.num_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.num_steps = int(state["num_steps"])
