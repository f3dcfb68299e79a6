"""What `full-train`, `train` and `eval` do once their options are resolved (imports the heavy stack).

Before anything starts, `miles.run_guard.preflight` checks every input and the run directory
(`--dry-run` runs the same checks). A training run then holds its run directory's lock; SIGTERM
stops it like Ctrl-C, and either way the user is told what was kept and the command that resumes.
"""

from __future__ import annotations

import os
from pathlib import Path

import typer
from rich.console import Console
from rich.markup import escape

from miles.errors import UserError
from miles.hardware import check_hardware_present
from miles.run_guard import guarded, preflight

console = Console()
_stderr = Console(stderr=True)


def check_can_run(cfg, *, trains: bool = True) -> None:
    """What a plan (--dry-run) may describe but this build cannot start: several training nodes (not
    for an eval, which starts no trainer), and SGLang engines without the GPUs and packages they need."""
    if trains and cfg.cluster.actor_num_nodes != 1:  # a plan (--dry-run) may span nodes; running one needs multi-node training
        raise UserError(
            "--actor-num-nodes > 1 needs a multi-node Ray cluster, which this build's trainer does not launch yet; "
            "use 1 (--dry-run prints the multi-node plan).",
            option="--actor-num-nodes",
        )
    if cfg.rollout.rollout_backend == "sglang":
        from miles.rollout.sglang.preflight import check_can_launch

        check_can_launch(cfg)


def execute(inv, *, checkpoint: str | None = None):
    """Run a resolved invocation (miles_cli.api.Invocation); the training RunResult, or None for eval."""
    cfg = inv.config
    # First what no machine can run (this build's gaps, a plan that cannot fit: true on any machine),
    # then a GPU asked for and not on this one.
    if inv.command != "eval":
        from miles_cli.run_plan import check_can_train

        check_can_train(inv)
    check_hardware_present(inv.options.hardware, ray_address=cfg.cluster.ray_address)
    check_can_run(cfg, trains=inv.command != "eval")
    os.environ.update(inv.env)
    # A quiet console: no Hugging Face bars for loading or writing weights (set it to 0 to see them).
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    preflight(inv, checkpoint)
    if inv.command == "eval":
        from miles.eval.run import run_eval

        run_eval(cfg, checkpoint=checkpoint, run_dir=inv.options.run_dir)
        return None
    from miles.ray.actor_death import ActorDied
    from miles.run_stop import kept_report, stop_exit_code, stop_report

    kept = dict(save_dir=cfg.ckpt.save, load_dir=cfg.ckpt.load, run_dir=inv.options.run_dir, save_interval=cfg.ckpt.save_interval)
    try:
        with guarded(inv) as guard:
            if inv.command == "full-train":
                from miles.prepare.runner import run_prepare_steps

                run_prepare_steps(inv.plan.prepare)
                guard.inputs_ready()
            from miles.run_progress import completed_run

            done = completed_run(cfg, inv.options.run_dir)
            if done is not None:
                # Nothing to train: start nothing and leave the run's record as what trained (issue 28).
                return _print_completed(inv, done)
            from miles.ray.driver import run_training
            from miles_cli.output import write_options_file

            # Training runs only: an eval is a reader and never writes into a run directory.
            written = write_options_file(inv)
            console.print(f"[dim]Every option: {escape(str(written))}[/dim]", highlight=False, soft_wrap=True)
            result = run_training(cfg, run_dir=inv.options.run_dir, run_id=inv.options.run_id, env=inv.env)
    except KeyboardInterrupt as e:
        _stderr.print(escape(stop_report(e, **kept)), highlight=False, soft_wrap=True)
        raise typer.Exit(stop_exit_code(e)) from None
    except ActorDied as e:
        from miles.run_stop import resume_command

        _stderr.print(f"[bold red]Error:[/bold red] {escape(str(e))}", highlight=False, soft_wrap=True)
        _stderr.print(escape(f"{kept_report(**kept)}\n  {resume_command()}"), highlight=False, soft_wrap=True)
        raise typer.Exit(1) from None
    print_result(result)
    return result


def _print_completed(inv, done):
    from miles.ray.driver import RunResult

    result = RunResult(Path(inv.options.run_dir), done.final_step, done.first_eval, done.last_eval, done.plot, done.last_rollout)
    console.rule("[bold]Run already complete")
    console.print(
        f"The run finished at rollout {done.last_rollout} (--num-rollout {done.final_step}): nothing to train, so nothing "
        "was started and its record (options.json, run.json, MLflow, metrics) is unchanged. Use another --run-id for a new run.",
        highlight=False,
    )
    _print_outcome(result)
    return result


def print_result(result) -> None:
    console.rule("[bold]Run finished")
    if result.resumed_from is not None:
        console.print(f"Resumed from the checkpoint of rollout {result.resumed_from}.")
    _print_outcome(result)


def _print_outcome(result) -> None:
    from miles.tracking.console import eval_headline_keys

    for key in eval_headline_keys(result.last_eval):
        before = result.first_eval.get(key)
        after = result.last_eval[key]
        if before is not None:
            console.print(f"{key}: {before:.3f} before training → {after:.3f} after ({after - before:+.3f})")
        else:
            console.print(f"{key}: {after:.3f}")
    written = [name for name in ("metrics.jsonl", "checkpoints", "mlflow.db", "tensorboard") if (result.run_dir / name).exists()]
    console.print(f"Outputs: {result.run_dir} ({', '.join(written)})")
    if result.plot:
        console.print(f"Plot: {result.plot}")
