"""How a run stops early: SIGTERM ends it like Ctrl-C, and the user is told what was kept.

    with stop_signals():          # SIGTERM raises Stopped("SIGTERM") in the main thread
        run()                     # finally-blocks run: MLflow KILLED, placement group removed, Ray shut down
    except KeyboardInterrupt as e:
        print(stop_report(e, save_dir=..., run_dir=..., command=...)); exit(stop_exit_code(e))

`Stopped` subclasses `KeyboardInterrupt`, so every cleanup written for Ctrl-C (the tracker marks the
MLflow run KILLED, the driver removes its placement group and shuts Ray down) also runs for SIGTERM,
which a scheduler (SLURM, Kubernetes, `kill`) sends. Ray's `ray.init()` installs a SIGTERM handler
that only calls `sys.exit`; the driver puts this one back after it. A second SIGINT/SIGTERM while the
run is cleaning up is ignored (with a note), so the cleanup that keeps the run resumable finishes.
"""

from __future__ import annotations

import contextlib
import shlex
import signal
import sys
from pathlib import Path
from typing import Iterator


class Stopped(KeyboardInterrupt):
    """The run was asked to stop by a signal (the signal's name is the message)."""

    def __init__(self, signal_name: str):
        super().__init__(signal_name)
        self.signal_name = signal_name


_stopping = False
_received: str | None = None  # Ray's blocking calls re-raise a plain KeyboardInterrupt: remember the signal here


def _handler(signum: int, frame) -> None:
    global _stopping, _received
    name = signal.Signals(signum).name
    if _stopping:
        print(f"\n{name} received again: already stopping (releasing Ray, closing MLflow); kill -9 to abort.", file=sys.stderr, flush=True)
        return
    _stopping = True
    _received = name
    raise Stopped(name)


@contextlib.contextmanager
def stop_signals() -> Iterator[None]:
    """SIGTERM and SIGINT raise `Stopped` (once) in the main thread while the block runs."""
    global _stopping, _received
    _stopping, _received = False, None
    previous = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    for s in previous:
        signal.signal(s, _handler)
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def _signal_name(error: BaseException) -> str:
    return getattr(error, "signal_name", None) or _received or "SIGINT"


def stop_exit_code(error: BaseException) -> int:
    """128 + the signal number, as a shell reports a process ended by that signal."""
    return 128 + int(getattr(signal, _signal_name(error), signal.SIGINT))


def resume_command(argv: list[str] | None = None) -> str:
    return "miles " + shlex.join(sys.argv[1:] if argv is None else argv)


def kept_report(*, save_dir: str | None, load_dir: str | None, run_dir: str | Path, save_interval: int | None) -> str:
    """What a stopped run keeps and how to continue it, in two sentences."""
    from miles.ckpt.checkpoint_dir import read_tracker

    metrics = Path(run_dir) / "metrics.jsonl"
    logged = f" and the metrics in {metrics}" if metrics.exists() else ""
    if not save_dir:
        return f"Kept: no checkpoint (--save is not set){logged}; rerunning starts over:"
    try:
        last = read_tracker(save_dir, flag="--save")
    except Exception:
        last = None
    if last is None:
        every = f" (every {save_interval} rollouts)" if save_interval else ""
        return f"Kept: no checkpoint yet{every}{logged}; rerunning starts from the beginning:"
    same = load_dir and Path(load_dir).absolute() == Path(save_dir).absolute()
    how = "resume from it with" if same else f"resume from it by adding --load {save_dir} to"
    return f"Kept: the checkpoint of rollout {last} in {save_dir}{logged}; {how}:"


def stop_report(error: BaseException, **kept) -> str:
    name = _signal_name(error)
    what = "Ctrl-C" if name == "SIGINT" else name
    return f"Stopped by {what}. {kept_report(**kept)}\n  {resume_command()}"
