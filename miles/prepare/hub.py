"""Prepare step: fetch a model or dataset from the Hugging Face Hub into a local directory, once.

    download(repo_id="Qwen/Qwen3-4B", local_dir="runs/models/Qwen3-4B")
    hub_checkpoint_dir("Qwen/Qwen3-4B", "runs/models")   # -> "runs/models/Qwen--Qwen3-4B" (None for a directory)

`--hf-checkpoint` takes a directory or a Hub id: a value given by the user that is not an existing
path and reads `owner/name` is a Hub id; `miles full-train` downloads it into
`<--model-dir>/<owner>--<name>` (a prepare step like the recipes' own downloads) and the run uses that
directory; `miles train`/`eval` use the directory once it is there.

Uses `huggingface_hub.snapshot_download` (resumable: partial files are kept as `*.incomplete` and
continued; progress bars per file). The step is complete when `<local_dir>/.miles-download-complete`
exists; it is written only after the download returns, so an interrupted download is resumed, not
trusted. Offline (`HF_HUB_OFFLINE=1`, no network, or the Hub unreachable) it is a user error naming
the exact `hf download ...` command to run where there is network and the directory to put the
files in.
"""

from __future__ import annotations

import os
import re
import shlex
from pathlib import Path

from miles.errors import UserError

SENTINEL = ".miles-download-complete"
_HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*")


def hub_checkpoint_dir(value: str | None, model_dir: str) -> str | None:
    """Where a Hub id given as --hf-checkpoint is downloaded to; None when `value` is a local path
    (it exists, or it is not of the form owner/name)."""
    if not value or Path(value).expanduser().exists() or not _HUB_ID.fullmatch(value) or value.endswith((".", "..")):
        return None
    return str(Path(model_dir) / value.replace("/", "--"))


def sentinel(local_dir: str) -> str:
    return str(Path(local_dir) / SENTINEL)


def hf_download_command(repo_id: str, local_dir: str, repo_type: str = "model", allow_patterns: tuple[str, ...] | list[str] = ()) -> str:
    cmd = ["hf", "download", repo_id]
    if repo_type != "model":
        cmd += ["--repo-type", repo_type]
    for pattern in allow_patterns:
        cmd += ["--include", pattern]
    return shlex.join(cmd + ["--local-dir", local_dir])


def _offline_error(repo_id: str, local_dir: str, repo_type: str, allow_patterns, why: str) -> UserError:
    return UserError(
        f"cannot download {repo_id} from the Hugging Face Hub ({why}); run "
        f"`{hf_download_command(repo_id, local_dir, repo_type, allow_patterns)}` on a machine with network, "
        f"put the files in {local_dir}, then create {sentinel(local_dir)} (or rerun miles full-train online).",
        option="--model-dir" if repo_type == "model" else "--data-dir",
    )


def download(repo_id: str, local_dir: str, repo_type: str = "model", allow_patterns: list[str] | None = None) -> None:
    patterns = list(allow_patterns or [])
    if os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in {"1", "true", "yes", "on"}:
        raise _offline_error(repo_id, local_dir, repo_type, patterns, "HF_HUB_OFFLINE is set")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError, OfflineModeIsEnabled

    Path(local_dir).mkdir(parents=True, exist_ok=True)
    try:
        snapshot_download(repo_id, repo_type=repo_type, local_dir=local_dir, allow_patterns=patterns or None)
    except (LocalEntryNotFoundError, OfflineModeIsEnabled) as e:
        raise _offline_error(repo_id, local_dir, repo_type, patterns, f"the Hub is unreachable: {str(e).splitlines()[0]}") from None
    if not any(p.name != ".cache" for p in Path(local_dir).iterdir()):
        raise UserError(f"downloading {repo_id} gave no files in {local_dir}; check the repository id.", option="--model-name")
    Path(sentinel(local_dir)).write_text(repo_id + "\n")
