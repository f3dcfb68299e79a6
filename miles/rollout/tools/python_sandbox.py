"""The built-in `python` tool: run a snippet in a separate, limited Python process and return its output.

Limits, all enforced by the operating system or the interpreter rather than by reading the code:

- wall time: the process group is killed after `timeout_s` (and RLIMIT_CPU stops a busy loop anyway);
- memory: RLIMIT_AS of `memory_mb` (an allocation beyond it raises MemoryError inside the snippet);
- files: it runs in a fresh temporary directory (its working directory), removed afterwards; `python -I`
  (no user site, no PYTHON* environment), an empty environment;
- network: a new user + network namespace with only a down loopback where the kernel allows unprivileged
  namespaces, and in any case an audit hook in the interpreter that refuses to create or connect sockets.

It is a fence for a model's arithmetic and string work, not a jail for hostile code (no seccomp, the
file system outside the temporary directory is readable). Output (stdout then stderr) is cut to
`max_output_chars`.
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import resource
import signal
import sys
import tempfile

_CLONE_NEWUSER = 0x10000000
_CLONE_NEWNET = 0x40000000

# Runs before the snippet in the child interpreter; an audit hook cannot be removed once added.
_BOOTSTRAP = r"""
import sys
def _no_network(event, args):
    if event in ("socket.__new__", "socket.connect", "socket.bind", "socket.getaddrinfo", "socket.sendto"):
        raise PermissionError("network access is disabled in the python tool")
sys.addaudithook(_no_network)
del _no_network
import runpy
sys.argv = ["snippet.py"]
runpy.run_path("snippet.py", run_name="__main__")
"""


def _limit_child(memory_bytes: int, cpu_s: int) -> None:
    """preexec_fn: runs in the forked child before exec (single-threaded there)."""
    resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    try:  # no network namespace on kernels that forbid unprivileged user namespaces: the audit hook remains
        ctypes.CDLL(None, use_errno=True).unshare(_CLONE_NEWUSER | _CLONE_NEWNET)
    except Exception:  # noqa: BLE001 - best effort, see above
        pass


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit] + f"\n... [{len(text) - limit} more characters cut]"


async def run_python(code: str, *, timeout_s: float = 10.0, memory_mb: int = 512, max_output_chars: int = 4000) -> str:
    """The snippet's stdout (and stderr, when not empty), or an `Error: ...` line; never raises for the
    snippet's failures."""
    if not isinstance(code, str) or not code.strip():
        return "Error: give the code to run as a non-empty string."
    with tempfile.TemporaryDirectory(prefix="miles-python-tool-") as tmp:
        with open(os.path.join(tmp, "snippet.py"), "w") as f:
            f.write(code)
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-I", "-c", _BOOTSTRAP,
            cwd=tmp, env={"PATH": "/usr/bin:/bin", "HOME": tmp, "TMPDIR": tmp},
            stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            preexec_fn=lambda: _limit_child(memory_mb * 1024**2, max(1, int(timeout_s) + 1)),
            start_new_session=True,  # its own process group: a timeout kills what it spawned too
        )
        try:
            out, err = await asyncio.wait_for(proc.communicate(), timeout=timeout_s)
        except asyncio.TimeoutError:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            await proc.wait()
            return f"Error: the code ran longer than {timeout_s:g} s and was stopped."
        finally:
            if proc.returncode is None:  # cancelled (the rollout aborted): do not leave it running
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
    stdout, stderr = out.decode(errors="replace"), err.decode(errors="replace")
    if proc.returncode != 0:
        if proc.returncode < 0:
            why = f"killed by signal {signal.Signals(-proc.returncode).name}"
            if -proc.returncode == signal.SIGXCPU:
                why = f"it used more than {timeout_s:g} s of CPU"
            return _cut(f"Error: the code was stopped ({why}).\n{stdout}{stderr}".rstrip(), max_output_chars)
        tail = stderr.strip().splitlines()[-1] if stderr.strip() else f"exit status {proc.returncode}"
        return _cut(f"{stdout}Error: {tail}".strip(), max_output_chars)
    return _cut((stdout + (f"\n[stderr]\n{stderr}" if stderr.strip() else "")).rstrip("\n") or "(no output)", max_output_chars)
