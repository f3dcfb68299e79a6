"""`miles full-train --train-backend megatron` through the real CLI: prepare (with the torch_dist
convert step), the Ray loop on the megatron-core trainer, weight syncs checked against the trainer
(`--check-weight-update-equal`, on in debug_minimal), checkpoints, and a resume that finds the run
complete. Slow: about 3-8 minutes on 2 cores depending on load.

The learning tests run the default recipe (500 rollouts) on megatron, with one worker and with TP=2
over two workers, and hold it to the torch backend's bar: held-out greedy accuracy at least 0.2
above the SFT warm start. About 10-15 minutes each on an idle 2-core machine, several times that
under load.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

MILES = [sys.executable, "-m", "miles_cli.main"]


@pytest.mark.slow
def test_debug_minimal_megatron_runs_the_whole_loop(tmp_path: Path):
    args = ["full-train", "--mode", "debug_minimal", "--train-backend", "megatron", "--model-dir", str(tmp_path / "models"),
            "--data-dir", str(tmp_path / "data"), "--output-dir", str(tmp_path / "runs"), "--run-id", "mg"]
    r = subprocess.run(MILES + args, cwd=tmp_path, capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    run_dir = tmp_path / "runs" / "mg"
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert sorted({row["step"] for row in rows}) == [0, 1, 2, 3]
    assert any("train/grad_norm" in row for row in rows)
    assert list((tmp_path / "models").glob("*_torch_dist"))  # the recipe's convert step ran
    assert (run_dir / "checkpoints" / "latest_checkpointed_iteration.txt").read_text().strip() == "2"  # rollout ids 0, 1, 2


@pytest.mark.slow
def test_debug_minimal_megatron_on_two_workers_with_tp2(tmp_path: Path):
    """Two training workers (TP=2) through the driver: the collective weight buckets (TP shards
    all-gathered, checked against the trainer by --check-weight-update-equal) and per-rank checkpoints
    of the TrainerBackend interface. About 2-4 minutes on 2 cores."""
    args = ["full-train", "--mode", "debug_minimal", "--train-backend", "megatron", "--model-dir", str(tmp_path / "models"),
            "--data-dir", str(tmp_path / "data"), "--output-dir", str(tmp_path / "runs"), "--run-id", "mg2",
            "--num-gpus-per-node", "2", "--tensor-model-parallel-size", "2", "--save-hf", str(tmp_path / "hf_{rollout_id}")]
    r = subprocess.run(MILES + args, cwd=tmp_path, capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    run_dir = tmp_path / "runs" / "mg2"
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert sorted({row["step"] for row in rows}) == [0, 1, 2, 3]
    assert any("train/grad_norm" in row for row in rows)
    ckpt = run_dir / "checkpoints" / "iter_0000002"
    assert (run_dir / "checkpoints" / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    assert sorted(p.name for p in ckpt.glob("rank_*.pt")) == ["rank_00000.pt", "rank_00001.pt"]  # one file per rank
    # The TP=2 checkpoints/ converts to HF with no other option (the config from the run's run.json),
    # bit for bit the weights the trainer exported at that save (--save-hf).
    from safetensors.torch import load_file

    def weights(d: Path) -> dict:
        return {k: v for f in sorted(d.glob("*.safetensors")) for k, v in load_file(str(f)).items()}

    c = subprocess.run(MILES + ["convert", "--from", "torch_dist", "--to", "hf", "--load", str(run_dir / "checkpoints"),
                                "--save", str(tmp_path / "converted")], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert c.returncode == 0, c.stdout[-3000:] + c.stderr[-3000:]
    got, trained = weights(tmp_path / "converted"), weights(tmp_path / "hf_2")
    assert got.keys() == trained.keys() and [k for k in got if not torch.equal(got[k], trained[k])] == []


def _learns(tmp_path: Path, run_id: str, *extra: str) -> None:
    args = ["full-train", "--train-backend", "megatron", "--model-dir", str(tmp_path / "models"),
            "--data-dir", str(tmp_path / "data"), "--output-dir", str(tmp_path / "runs"), "--run-id", run_id, *extra]
    r = subprocess.run(MILES + args, cwd=tmp_path, capture_output=True, text=True, timeout=5400)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "runs" / run_id / "metrics.jsonl").read_text().splitlines()]
    evals = [row["eval/arith/accuracy"] for row in rows if "eval/arith/accuracy" in row]
    assert evals[-1] >= evals[0] + 0.2, (evals, r.stdout[-2000:])
    diffs = [row["train/train_rollout_logprob_abs_diff"] for row in rows if "train/train_rollout_logprob_abs_diff" in row]
    assert max(diffs) < 1e-4, max(diffs)  # megatron scores the (T = 0.8) policy the engine sampled


@pytest.mark.slow
@pytest.mark.timeout(5400)  # 500 rollouts: ~25 min at load average 30 on 2 cores
def test_default_megatron_full_train_learns(tmp_path: Path):
    _learns(tmp_path, "mg-learn")


@pytest.mark.slow
@pytest.mark.timeout(5400)
def test_default_megatron_full_train_learns_with_tp2_on_two_workers(tmp_path: Path):
    _learns(tmp_path, "mg-learn-tp2", "--tensor-model-parallel-size", "2", "--num-gpus-per-node", "2")
