"""Never lose or overwrite a run, through the real `miles` program (issue 14).

One `--mode debug_minimal` run with the default run id is the "earlier run" the other commands must
not touch. Then: a normal run with the default id gets its own directory (and naming the debug run's
id is refused before any prepare step); `miles train --load OTHER` into the finished run's directory
is refused and changes nothing; `miles eval --checkpoint` while a save is in progress leaves the
directory as it was; a second run on a live run's directory is refused naming the holder's pid;
SIGTERM and a killed training actor end the run with one message, MLflow KILLED/FAILED, and no
process of the run left behind.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

MILES = [sys.executable, "-m", "miles_cli.main"]
DEBUG_ID = "tiny-qwen3-debug_minimal"


def miles(args: list[str], cwd: Path, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run(MILES + args, cwd=cwd, capture_output=True, text=True, timeout=timeout)


def where(work: Path) -> list[str]:
    return ["--model-dir", str(work / "models"), "--data-dir", str(work / "data"), "--output-dir", str(work / "runs")]


def one_line(text: str) -> str:
    return " ".join(text.split())


def snapshot(root: Path) -> list[tuple[str, int, int]]:
    return sorted((str(p.relative_to(root)), p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*") if p.is_file())


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    """A finished debug_minimal run with the default run id (what the getting-started page suggests first)."""
    work = tmp_path_factory.mktemp("safety")
    r = miles(["full-train", "--mode", "debug_minimal", *where(work)], work)
    assert r.returncode == 0, r.stderr[-3000:]
    assert (work / "runs" / DEBUG_ID / "checkpoints" / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    # A run that trains names its options file once it is written (issue 28: a failed start names none).
    assert f"Every option: {work / 'runs' / DEBUG_ID / 'options.json'}\n" in r.stdout, r.stdout[:3000]
    assert (work / "runs" / DEBUG_ID / "options.json").is_file()
    return work


def test_debug_run_then_normal_run_with_default_ids_never_meet(work):
    assert not (work / "runs" / "tiny-qwen3").exists()
    r = miles(["full-train", "--dry-run", *where(work)], work)
    assert r.returncode == 0, r.stderr[-2000:]
    assert f"Run directory: {work / 'runs'}/tiny-qwen3\n" in r.stdout.replace(str(work / "runs") + "/", f"{work / 'runs'}/")
    r = miles(["full-train", "--mode", "debug_minimal", "--prepare-seed", "1", "--dry-run", *where(work)], work)
    assert "tiny-qwen3-debug_minimal-seed1" in r.stdout
    # Naming the debug run's id for a normal run is refused before the 375-step warm start is prepared.
    before = snapshot(work / "runs" / DEBUG_ID)
    r = miles(["full-train", "--run-id", DEBUG_ID, *where(work)], work)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "--mode debug_minimal then, normal now" in one_line(r.stderr) and "--run-id" in r.stderr
    assert not any("sft375" in p.name for p in (work / "models").iterdir())
    # A run prepared from another seed under the debug run's id: refused too (it used to report
    # "already complete" and tag the seed-0 MLflow run).
    r = miles(["full-train", "--mode", "debug_minimal", "--prepare-seed", "1", "--run-id", DEBUG_ID, *where(work)], work)
    assert r.returncode == 2 and "--prepare-seed 0 then, 1 now" in one_line(r.stderr), r.stderr[-2000:]
    assert snapshot(work / "runs" / DEBUG_ID) == before


@pytest.mark.parametrize("argv", [
    ["full-train", "--mode", "debug_minimal"],                   # the same command again
    ["train", "--mode", "debug_minimal", "--lr", "1e-5"],        # a changed option that would train nothing
])
def test_a_rerun_that_trains_nothing_changes_nothing_in_the_run(work, argv):
    """options.json, run.json, MLflow (params, tags, metrics) and metrics.jsonl keep saying what trained (issue 28)."""
    run_dir = work / "runs" / DEBUG_ID
    def record() -> list:  # everything but the run lock, which every command that may train takes
        return [f for f in snapshot(run_dir) if f[0] != ".miles-run.lock"]

    before = record()
    r = miles([*argv, *where(work)], work)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "nothing to train" in one_line(r.stdout) and "Resumed from" not in r.stdout, r.stdout[-2000:]
    assert record() == before
    assert json.loads((run_dir / "options.json").read_text())["command"] == "full-train"


def test_train_load_other_into_a_finished_run_is_refused_and_changes_nothing(work):
    other = work / "other_checkpoints"
    if not other.exists():
        shutil.copytree(work / "runs" / DEBUG_ID / "checkpoints", other)
        (other / "latest_checkpointed_iteration.txt").write_text("1\n")
    before = snapshot(work / "runs" / DEBUG_ID)
    r = miles(["train", "--mode", "debug_minimal", *where(work), "--", "--load", str(other)], work)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "already holds the checkpoints of a run (up to rollout 2)" in one_line(r.stderr) and "--run-id" in r.stderr
    assert "Traceback" not in r.stderr
    assert snapshot(work / "runs" / DEBUG_ID) == before


def test_eval_while_a_save_is_in_progress_changes_nothing(work):
    ckpt = work / "runs" / DEBUG_ID / "checkpoints"
    # What a live run's save looks like half-way: its temp directory and tracker temp file.
    partial = ckpt / f".tmp-iter_0000003-{os.getpid()}"
    partial.mkdir(exist_ok=True)
    (partial / "trainer_state.pt").write_bytes(b"half a checkpoint")
    (ckpt / f".tmp-latest_checkpointed_iteration.txt-{os.getpid()}").write_text("3\n")
    before = snapshot(ckpt)
    r = miles(["eval", "--mode", "debug_minimal", *where(work), "--checkpoint", str(ckpt)], work)
    assert r.returncode == 0, r.stderr[-2000:]
    assert snapshot(ckpt) == before
    assert json.loads((work / "runs" / DEBUG_ID / "eval" / "rollout_2.json").read_text())


def _descendants(pid: int):
    import psutil

    return psutil.Process(pid).children(recursive=True)


def _wait_for(predicate, proc: subprocess.Popen, what: str, timeout: float = 400) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert proc.poll() is None, f"the run ended before {what}"
        assert time.monotonic() < deadline, f"no {what} after {timeout} s"
        time.sleep(0.2)


def _gone(procs, timeout: float = 30) -> list[int]:
    import psutil

    _, alive = psutil.wait_procs(procs, timeout=timeout)
    return [p.pid for p in alive if p.status() != psutil.STATUS_ZOMBIE]


def _mlflow_status(run_dir: Path) -> str:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{run_dir.resolve() / 'mlflow.db'}")
    return client.get_run((run_dir / "mlflow_run_id.txt").read_text().strip()).info.status


def _start(work: Path, run_id: str, log: Path) -> tuple[list[str], subprocess.Popen]:
    args = ["full-train", "--mode", "debug_minimal", *where(work), "--run-id", run_id, "--", "--num-rollout", "200", "--save-interval", "1"]
    with log.open("w") as out:
        proc = subprocess.Popen(MILES + args, cwd=work, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    return args, proc


@pytest.mark.slow  # a real run stopped mid-way: minutes on a busy 2-core machine (tests/safety covers the pieces)
def test_second_run_on_a_live_run_dir_is_refused_and_sigterm_stops_like_ctrl_c(work):
    args, proc = _start(work, "live", work / "live.log")
    run_dir = work / "runs" / "live"
    try:
        _wait_for(lambda: (run_dir / "checkpoints" / "iter_0000000").exists(), proc, "a first checkpoint")
        second = miles(args, work)
        assert second.returncode == 2, second.stderr[-2000:]
        assert f"is in use by a live run (pid {proc.pid}," in one_line(second.stderr) and "--run-id" in second.stderr
        procs = _descendants(proc.pid)
        assert any("TrainWorker" in " ".join(p.cmdline()) for p in procs)
        os.kill(proc.pid, signal.SIGTERM)  # what `kill`, SLURM or Kubernetes send
        assert proc.wait(timeout=180) == 128 + signal.SIGTERM
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    out = one_line((work / "live.log").read_text())
    assert "Stopped by SIGTERM. Kept: the checkpoint of rollout" in out
    assert "miles " + " ".join(args) in out  # the command that resumes it
    assert "Traceback" not in out
    assert _mlflow_status(run_dir) == "KILLED"
    assert _gone(procs) == []


@pytest.mark.slow  # tests/ray/test_driver.py kills a worker in-process in the default run
def test_a_killed_training_actor_ends_the_run_with_one_sentence(work):
    args, proc = _start(work, "crash", work / "crash.log")
    run_dir = work / "runs" / "crash"
    try:
        _wait_for(lambda: (run_dir / "checkpoints" / "iter_0000000").exists(), proc, "a first checkpoint")
        procs = _descendants(proc.pid)
        worker = next(p for p in procs if "TrainWorker" in " ".join(p.cmdline()))
        worker.kill()
        assert proc.wait(timeout=180) == 1
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    out = one_line((work / "crash.log").read_text())
    assert f"Error: the TrainWorker of rank 0 (pid {worker.pid}) died while the driver waited for" in out
    assert "Kept: the checkpoint of rollout" in out
    assert "Traceback" not in out
    assert _mlflow_status(run_dir) == "FAILED"
    assert _gone(procs) == []
