"""Kill a run the hard way: start `miles ...` in its own process group and SIGKILL the whole group
(driver, Ray node, actors, engines) the moment a file appears, as a crash or an OOM killer would."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

MILES = [sys.executable, "-m", "miles_cli.main"]


def sigkill_once_exists(args: list[str], cwd: Path, path: Path, *, timeout: float = 600, what: str = "its second checkpoint") -> None:
    """Run `miles args` in `cwd` and SIGKILL its process group as soon as `path` exists; fails if the run
    ends first or `path` does not appear within `timeout` seconds."""
    proc = subprocess.Popen(MILES + args, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + timeout
        while not path.exists():
            assert proc.poll() is None, f"the run ended before {what}"
            assert time.monotonic() < deadline, f"no {what} after {timeout:.0f} s"
            time.sleep(0.05)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
