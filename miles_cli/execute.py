"""What `full-train`, `train` and `eval` do once their options are resolved (imports the heavy stack)."""

from __future__ import annotations

import os
from pathlib import Path

from rich.console import Console

from miles.errors import UserError

console = Console()


def _require_inputs(cfg, command: str) -> None:
    hint = " Run `miles full-train` to prepare it." if command == "train" else ""
    if not cfg.rollout.hf_checkpoint or not (Path(cfg.rollout.hf_checkpoint) / "config.json").is_file():
        raise UserError(f"--hf-checkpoint {cfg.rollout.hf_checkpoint} is not a Hugging Face model directory.{hint}", option="--hf-checkpoint")
    if command != "eval" and not Path(cfg.data.prompt_data).is_file():
        raise UserError(f"--prompt-data {cfg.data.prompt_data} does not exist.{hint}", option="--prompt-data")


def execute(inv, *, checkpoint: str | None = None) -> None:
    cfg = inv.config
    if cfg.cluster.actor_num_nodes != 1:  # a plan (--dry-run) may span nodes; running one needs multi-node training
        raise UserError(
            "--actor-num-nodes > 1: this build's trainer does not start training workers on several nodes yet; "
            "use 1 (--dry-run prints the multi-node plan).",
            option="--actor-num-nodes",
        )
    if cfg.rollout.rollout_backend == "sglang":
        from miles.rollout.sglang.preflight import check_can_launch, check_engines_wired

        check_can_launch(cfg)
        check_engines_wired()
    os.environ.update(inv.plan.env)
    if inv.command == "full-train":
        from miles.prepare.runner import run_prepare_steps

        run_prepare_steps(inv.plan.prepare)
    _require_inputs(cfg, inv.command)
    if inv.command == "eval":
        from miles.eval.run import run_eval

        run_eval(cfg, checkpoint=checkpoint, run_dir=inv.options.run_dir)
        return
    from miles.ray.driver import run_training

    result = run_training(cfg, run_dir=inv.options.run_dir, run_id=inv.options.run_id, env=inv.plan.env)
    print_result(result)


def print_result(result) -> None:
    console.rule("[bold]Run finished")
    if result.resumed_from is not None:
        console.print(f"Resumed from the checkpoint of rollout {result.resumed_from}.")
        if result.resumed_from + 1 >= result.final_step:
            console.print("The run was already complete: nothing to train. Use another --run-id for a new run.")
    for key in sorted(k for k in result.last_eval if k.endswith("/accuracy")):
        before = result.first_eval.get(key)
        after = result.last_eval[key]
        if before is not None:
            console.print(f"{key}: {before:.3f} before RL → {after:.3f} after ({after - before:+.3f})")
        else:
            console.print(f"{key}: {after:.3f}")
    written = [name for name in ("metrics.jsonl", "checkpoints", "mlflow.db", "tensorboard") if (result.run_dir / name).exists()]
    console.print(f"Outputs: {result.run_dir} ({', '.join(written)})")
    if result.plot:
        console.print(f"Plot: {result.plot}")
