"""Turn a dead Ray actor into one sentence that names it, plus the last lines of its log.

    except ray.exceptions.RayActorError as e:
        raise ActorDied(describe(e, "training on rollout 3")) from None

Which actor it was comes from the label `miles.ray.hosting.start_actor` registered for its actor
id ("training worker 0", "the rollout manager"); the pid from Ray's error; the log lines from Ray's
worker log files of that pid in the current session (`<session>/logs/worker-*-<pid>.{out,err}`).
"""

from __future__ import annotations

import re
from pathlib import Path

from miles.errors import StepFailed

LOG_LINES = 12


class ActorDied(StepFailed):
    """A Ray actor of the run died (killed, out of memory, crashed): the run cannot go on."""


def _pid(error: BaseException) -> int | None:
    m = re.search(r"\bpid: (\d+)", str(error))
    return int(m.group(1)) if m else None


def last_log_lines(pid: int, n: int = LOG_LINES) -> list[str]:
    try:
        import ray

        session = Path(ray._private.worker._global_node.get_session_dir_path())
    except Exception:
        return []
    lines: list[str] = []
    for f in sorted((session / "logs").glob(f"worker-*-{pid}.*")):
        if f.suffix in (".out", ".err"):
            try:
                lines += [line for line in f.read_text(errors="replace").splitlines() if line.strip()]
            except OSError:
                pass
    return lines[-n:]


def describe(error: BaseException, what: str) -> str:
    from miles.ray.hosting import actor_label

    label = actor_label(getattr(error, "actor_id", None)) or "a Ray actor of the run"
    pid = _pid(error)
    reason = "it was killed or crashed"
    text = str(error)
    if "OOM" in text or "out of memory" in text.lower():
        reason = "it ran out of memory"
    sentence = f"{label}{f' (pid {pid})' if pid else ''} died while the driver waited for {what}: {reason}."
    tail = last_log_lines(pid) if pid else []
    if tail:
        sentence += "\nIts last log lines:\n" + "\n".join("  " + line for line in tail)
    return sentence
