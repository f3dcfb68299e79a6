"""The run lock and the run identity on their own: a dead holder frees the lock, a run that never
started leaves no directory, and which option changes make "another run"."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest

from miles.errors import UserError
from miles.run_identity import check_run_dir, identity_of, write_run_record
from miles.run_lock import LOCK_FILE, RunLock, holder
from recipes import RECIPES

TINY = RECIPES["tiny-qwen3"]


def test_a_live_holder_is_named_and_a_killed_one_frees_the_lock(tmp_path):
    run_dir = tmp_path / "run"
    script = textwrap.dedent(
        f"""
        import os, signal, sys
        from miles.run_lock import RunLock
        with RunLock([{str(run_dir)!r}]):
            print("locked", flush=True)
            sys.stdin.readline()
            os.kill(os.getpid(), signal.SIGKILL)
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "locked"
        assert holder(run_dir)["pid"] == proc.pid
        with pytest.raises(UserError, match=f"in use by a live run \\(pid {proc.pid},") as info:
            RunLock([run_dir]).__enter__()
        assert info.value.option == "--run-id"
        proc.stdin.write("\n")
        proc.stdin.flush()
        assert proc.wait(timeout=60) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
    assert holder(run_dir) is None  # the kernel released it: no stale lock
    with RunLock([run_dir]):
        assert json.loads((run_dir / LOCK_FILE).read_text())["pid"] == os.getpid()
    assert (run_dir / LOCK_FILE).exists()


def test_a_run_that_fails_before_it_starts_leaves_no_directory(tmp_path):
    fresh = tmp_path / "out" / "fresh"
    with pytest.raises(RuntimeError):
        with RunLock([fresh]):
            raise RuntimeError("bad input found under the lock")
    assert not (tmp_path / "out").exists()
    kept = tmp_path / "kept"
    kept.mkdir()
    (kept / "metrics.jsonl").write_text("{}\n")
    with pytest.raises(RuntimeError):
        with RunLock([kept]):
            raise RuntimeError("x")
    assert (kept / "metrics.jsonl").exists()


def _inv(tmp_path, data_text: str, **options):
    o = TINY.Options(output_dir=str(tmp_path / "runs"), **options).resolve()
    data = tmp_path / "train.jsonl"
    data.write_text(data_text)
    hf = tmp_path / "hf"
    hf.mkdir(exist_ok=True)
    (hf / "config.json").write_text("{}")
    cfg = SimpleNamespace(
        rollout=SimpleNamespace(hf_checkpoint=str(hf)),
        data=SimpleNamespace(prompt_data=str(data)),
        ckpt=SimpleNamespace(save=None, load=None),
    )
    return o, cfg


def test_what_makes_another_run(tmp_path):
    o, cfg = _inv(tmp_path, '{"input": "1+1=", "label": "2"}\n')
    ident = identity_of(o, cfg, inputs_ready=True)
    write_run_record(o.run_dir, o.run_id, ident)
    check_run_dir(o.run_dir, ident, cfg)  # the same run resumes
    # Where it runs, how many workers, extra engine flags: the same run.
    o2, cfg2 = _inv(tmp_path, '{"input": "1+1=", "label": "2"}\n', num_gpus_per_node=2, extra_args="--lr 1e-5")
    check_run_dir(o.run_dir, identity_of(o2, cfg2, inputs_ready=True), cfg2)
    # Another mode or prepare seed: another run.
    for change, expected in (({"mode": "debug_minimal"}, "--mode normal then, debug_minimal now"), ({"prepare_seed": 3}, "--prepare-seed 0 then, 3 now")):
        o3, cfg3 = _inv(tmp_path, '{"input": "1+1=", "label": "2"}\n', run_id=o.run_id, **change)
        with pytest.raises(UserError, match=expected) as info:
            check_run_dir(o.run_dir, identity_of(o3, cfg3, inputs_ready=True), cfg3)
        assert info.value.option == "--run-id"
    # The same prompt file path with other content: another run.
    o4, cfg4 = _inv(tmp_path, '{"input": "2+2=", "label": "4"}\n')
    with pytest.raises(UserError, match="--prompt-data .*whose content changed"):
        check_run_dir(o.run_dir, identity_of(o4, cfg4, inputs_ready=True), cfg4)
    assert json.loads((tmp_path / "runs" / o.run_id / "run.json").read_text())["run_id"] == "tiny-qwen3"


def test_default_run_ids_carry_mode_and_seed():
    assert TINY.Options().resolve().run_id == "tiny-qwen3"
    assert TINY.Options(mode="debug_minimal").resolve().run_id == "tiny-qwen3-debug_minimal"
    assert TINY.Options(prepare_seed=1).resolve().run_id == "tiny-qwen3-seed1"
    assert TINY.Options(mode="debug_minimal", prepare_seed=2).resolve().run_id == "tiny-qwen3-debug_minimal-seed2"
    assert TINY.Options(run_id="mine", mode="debug_minimal").resolve().run_id == "mine"
    qwen = RECIPES["qwen3-0.6b"]
    assert qwen.Options(mode="debug_minimal").resolve().run_id == "qwen3-0.6b-debug_minimal"


@pytest.mark.parametrize("sig, code, said", [(signal.SIGTERM, 143, "Stopped by SIGTERM."), (signal.SIGINT, 130, "Stopped by Ctrl-C.")])
def test_sigterm_stops_like_ctrl_c_even_through_a_plain_keyboard_interrupt(tmp_path, sig, code, said):
    """SIGTERM raises in the main thread like Ctrl-C; when a blocking call (Ray's get) turns it into a
    plain KeyboardInterrupt, the report and the exit code still name the signal that arrived."""
    script = textwrap.dedent(
        f"""
        import os, signal, sys, time
        from miles.run_stop import stop_exit_code, stop_report, stop_signals
        try:
            with stop_signals():
                try:
                    os.kill(os.getpid(), {int(sig)})
                    time.sleep(30)
                except KeyboardInterrupt:
                    raise KeyboardInterrupt from None  # what ray.get re-raises
        except KeyboardInterrupt as e:
            print(stop_report(e, save_dir=None, load_dir=None, run_dir={str(tmp_path)!r}, save_interval=None))
            sys.exit(stop_exit_code(e))
        """
    )
    r = subprocess.run([sys.executable, "-c", script, "full-train"], capture_output=True, text=True, timeout=60)
    assert r.returncode == code, r.stderr
    assert r.stdout.startswith(said) and "Kept: no checkpoint (--save is not set); rerunning starts over:" in r.stdout
    assert "miles full-train" in r.stdout
