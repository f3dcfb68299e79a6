"""Everything that keeps a `miles train`/`full-train` run from losing or overwriting work, in order.

    preflight(inv, checkpoint)          # before anything starts (and all --dry-run does)
    with guarded(inv) as guard:         # lock the run directory, refuse another run's directory,
        run_prepare_steps(...)          #   turn SIGTERM into a stop like Ctrl-C
        guard.inputs_ready()            # full-train: check what the prepare steps made, record run.json
        run_training(...)

`inv` is the CLI's resolved invocation (command, options, plan, config). The checks themselves live in
`miles.validate_inputs` (files, hooks, ports), `miles.run_identity` (which run a directory holds) and
`miles.run_lock` (which process holds it); the stop handling in `miles.run_stop`.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Iterator

from miles.hardware import MissingHardware, check_hardware_present
from miles.run_identity import check_run_dir, identity_of, write_run_record
from miles.run_lock import RunLock, holder, in_use_error
from miles.run_stop import stop_signals
from miles.validate_inputs import check_inputs


def pending_outputs(plan: Any) -> list[Path]:
    """The directories that full-train's prepare steps still have to create (their sentinel is missing)."""
    return [Path(step.sentinel).parent.absolute() for step in plan.prepare if not Path(step.sentinel).exists()]


def lock_dirs(inv: Any) -> list[Path]:
    """The run directory, and --save when it lies outside it (another run must not write there either)."""
    run_dir = Path(inv.options.run_dir).absolute()
    dirs = [run_dir]
    save = inv.config.ckpt.save
    if save and run_dir not in Path(save).absolute().parents and Path(save).absolute() != run_dir:
        dirs.append(Path(save).absolute())
    return dirs


def preflight(inv: Any, checkpoint: str | None = None, *, planning: bool = False) -> None:
    """Every check that needs no lock and writes nothing: the hardware asked for, inputs, then
    (training) the run directory. `planning` (--dry-run): GPUs missing here are reported, not refused,
    since planning a GPU run from a machine without them is what a dry run is for (memory plan)."""
    try:
        check_hardware_present(inv.options.hardware, ray_address=inv.config.cluster.ray_address)
    except MissingHardware as e:
        if not planning:
            raise
        import sys

        # stderr: the plan on stdout is the same on every machine (the frozen recipe plans compare it).
        print(f"Note: train/full-train here would exit 2: {e}", file=sys.stderr)
    pending = pending_outputs(inv.plan) if inv.command == "full-train" else []
    # For train: what full-train would create, so only a missing input there suggests it.
    creatable = pending_outputs(inv.plan) if inv.command == "train" else []
    check_inputs(inv.config, command=inv.command, checkpoint=checkpoint, pending=pending, creatable=creatable)
    if inv.command == "eval":
        return
    for d in lock_dirs(inv):
        info = holder(d)
        if info is not None:
            raise in_use_error(d, info)
    check_run_dir(inv.options.run_dir, identity_of(inv.options, inv.config, inputs_ready=not pending), inv.config)


class Guard:
    def __init__(self, inv: Any):
        self.inv = inv
        self._recorded = False

    def inputs_ready(self) -> None:
        """The inputs exist now: check them all, compare their content with the run's record, record it."""
        if self._recorded:
            return
        self._recorded = True
        inv = self.inv
        check_inputs(inv.config, command=inv.command)
        ident = identity_of(inv.options, inv.config, inputs_ready=True)
        check_run_dir(inv.options.run_dir, ident, inv.config)
        write_run_record(inv.options.run_dir, inv.options.run_id, ident)


@contextlib.contextmanager
def guarded(inv: Any) -> Iterator[Guard]:
    """Hold the run lock, turn SIGTERM into `Stopped`, and re-check the run directory under the lock."""
    with stop_signals(), RunLock(lock_dirs(inv)):
        # Checked again under the lock: another run may have started between preflight and now.
        pending = pending_outputs(inv.plan) if inv.command == "full-train" else []
        check_run_dir(inv.options.run_dir, identity_of(inv.options, inv.config, inputs_ready=not pending), inv.config)
        guard = Guard(inv)
        if not pending:
            guard.inputs_ready()
        yield guard
