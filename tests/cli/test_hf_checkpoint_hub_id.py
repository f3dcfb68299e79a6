"""`--hf-checkpoint` takes a Hugging Face Hub id as well as a directory.

`miles full-train --hf-checkpoint owner/name` adds a sentinel-guarded prepare step that downloads the
model into `<--model-dir>/owner--name` and runs on that directory; offline it exits 2 naming the exact
`hf download` command and the directory. `miles train` uses the directory once it is there and
otherwise says how to get it. A directory that exists, and the recipe's own paths, are never taken for
Hub ids. Through the real CLI (subprocesses, no network needed).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from miles.prepare.hub import hub_checkpoint_dir

MILES = [sys.executable, "-m", "miles_cli.main"]


def miles(args: list[str], cwd: Path, **env: str) -> subprocess.CompletedProcess:
    import os

    return subprocess.run(MILES + args, cwd=cwd, capture_output=True, text=True, timeout=300, env={**os.environ, "COLUMNS": "200", **env})


def test_what_counts_as_a_hub_id(tmp_path):
    assert hub_checkpoint_dir("Qwen/Qwen3-0.6B", "runs/models") == "runs/models/Qwen--Qwen3-0.6B"
    (tmp_path / "org" / "model").mkdir(parents=True)
    assert hub_checkpoint_dir(str(tmp_path / "org" / "model"), "m") is None  # an existing directory
    for local in ("runs/models/x", "/abs/x", "./x", "x", "a/..", None):
        assert hub_checkpoint_dir(local, "m") is None, local


def test_full_train_offline_exits_2_naming_the_hf_download_command_and_the_directory(tmp_path):
    r = miles(["full-train", "--model-dir", "m", "--data-dir", "d", "--output-dir", "runs", "--hf-checkpoint", "Qwen/Qwen3-0.6B"], tmp_path, HF_HUB_OFFLINE="1")
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
    assert "Traceback" not in r.stdout + r.stderr
    assert "`hf download Qwen/Qwen3-0.6B --local-dir m/Qwen--Qwen3-0.6B`" in r.stderr and "put the files in m/Qwen--Qwen3-0.6B" in r.stderr
    assert not (tmp_path / "runs").exists()  # the download is the first step: nothing else was prepared or written


def test_dry_run_plans_the_download_and_the_run_reads_the_downloaded_directory(tmp_path):
    from miles.prepare.hub import SENTINEL
    from miles.prepare.tiny_model import create_tiny_qwen3

    args = ["full-train", "--model-dir", "m", "--data-dir", "d", "--output-dir", "runs", "--hf-checkpoint", "Org/tiny", "--dry-run"]
    r = miles(args, tmp_path, HF_HUB_OFFLINE="1")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert "download-hf-checkpoint: download Org/tiny from the Hugging Face Hub into m/Org--tiny" in " ".join(r.stdout.split())
    assert "m/Org--tiny/.miles-download-complete (to run)" in " ".join(r.stdout.split())

    create_tiny_qwen3(tmp_path / "m" / "Org--tiny")  # as if downloaded
    (tmp_path / "m" / "Org--tiny" / SENTINEL).write_text("Org/tiny\n")
    r = miles(args, tmp_path, HF_HUB_OFFLINE="1")
    assert r.returncode == 0 and "m/Org--tiny/.miles-download-complete (complete)" in " ".join(r.stdout.split()), r.stdout[-3000:]
    r = miles(["train", *args[1:]], tmp_path)  # train reads the directory; what it still lacks is the recipe's data
    assert "--hf-checkpoint" not in r.stderr and "--prompt-data" in r.stderr, r.stderr


def test_train_without_the_download_says_how_to_get_it(tmp_path):
    r = miles(["train", "--model-dir", "m", "--output-dir", "runs", "--hf-checkpoint", "Qwen/Qwen3-0.6B", "--dry-run"], tmp_path)
    assert r.returncode == 2
    err = " ".join(r.stderr.split())
    assert "--hf-checkpoint m/Qwen--Qwen3-0.6B does not exist" in err and "the Hub id Qwen/Qwen3-0.6B" in err
    assert "`hf download Qwen/Qwen3-0.6B --local-dir m/Qwen--Qwen3-0.6B`" in err
