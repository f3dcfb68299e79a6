"""Prepare steps for the embedded default: the tiny model + tokenizer, and the arithmetic task.

- `miles.prepare.tiny_model.create_tiny_qwen3(out_dir, ...)`: a small Qwen3 HF checkpoint + tokenizer.
- `miles.prepare.arith_task.create_arith_task(out_dir, ...)`: train/eval JSONL of "a+b=" prompts.

Neither downloads anything. Both write their directory atomically through `build_once` below: the
step builds its output in a temporary sibling directory, writes `.miles-complete` (a JSON record of the parameters it was built from) as the very
last file, and renames the directory into place. A directory without the sentinel is a leftover of an
interrupted run and is rebuilt; a complete one built from other parameters is a user error (silently
reusing it would train on something other than what was asked for).

This is not a lock: two processes preparing the same directory at the same moment both build it; the
second rename fails, and the loser keeps the winner's (identical, deterministic) directory.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable

from miles.errors import UserError

SENTINEL = ".miles-complete"


def is_complete(out_dir: str | os.PathLike[str]) -> bool:
    """True when `out_dir` holds a finished prepare step (its sentinel exists)."""
    return (Path(out_dir) / SENTINEL).is_file()


def build_once(
    out_dir: str | os.PathLike[str],
    spec: dict[str, Any],
    build: Callable[[Path], None],
    *,
    what: str,
) -> Path:
    """Run `build(tmp_dir)` unless `out_dir` is already complete for the same `spec`; return `out_dir`.

    `spec` must be JSON-serialisable; it is stored in the sentinel and compared on the next call.
    """
    out = Path(out_dir).resolve()
    sentinel = out / SENTINEL
    spec = json.loads(json.dumps(spec, sort_keys=True))  # tuples -> lists, as read back
    if sentinel.is_file():
        found = json.loads(sentinel.read_text())
        if found != spec:
            raise UserError(
                f"{out} already holds a {what} built with {found}, not the requested {spec}; "
                "delete that directory or choose another output directory."
            )
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    os.chmod(tmp, 0o755)  # mkdtemp makes it private; the result is an ordinary directory
    try:
        build(tmp)
        (tmp / SENTINEL).write_text(json.dumps(spec, sort_keys=True) + "\n")
        if out.exists() and not sentinel.is_file():
            # An interrupted earlier run (no sentinel): nothing in it is trustworthy.
            shutil.rmtree(out)
        try:
            os.replace(tmp, out)
        except OSError:
            if not sentinel.is_file():
                raise
            shutil.rmtree(tmp, ignore_errors=True)  # another process finished first
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
