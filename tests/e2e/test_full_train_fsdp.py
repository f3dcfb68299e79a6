"""`miles full-train --train-backend fsdp` through the real CLI: the tiny recipe on two training
workers sharded with FSDP2 over gloo, from the recipe's cached SFT warm start (tests/conftest.py
`warm_start`), where rewards vary and every step has a gradient. debug_minimal turns on
--check-weight-update-equal, so every weight sync (each bucket gathered from both ranks' shards) is
checked against the trainer by checksum; the checkpoints hold one shard file per rank, and the same
command resumes the finished run. Slow: about 2-4 minutes on 2 busy cores.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

MILES = [sys.executable, "-m", "miles_cli.main"]


@pytest.mark.slow
@pytest.mark.timeout(3600)  # two CLI runs; 6 min at load average 30 on 2 cores
def test_debug_minimal_fsdp_on_two_workers(tmp_path: Path, warm_start):
    args = ["full-train", "--mode", "debug_minimal", "--train-backend", "fsdp", "--num-gpus-per-node", "2",
            "--model-dir", str(warm_start.model_dir), "--data-dir", str(warm_start.data_dir), "--sft-steps", "375",
            "--output-dir", str(tmp_path / "runs"), "--run-id", "fsdp2", "--save-hf", str(tmp_path / "hf_{rollout_id}")]
    r = subprocess.run(MILES + args, cwd=tmp_path, capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    run_dir = tmp_path / "runs" / "fsdp2"
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert sorted({row["step"] for row in rows}) == [0, 1, 2, 3]
    norms = [row["train/grad_norm"] for row in rows if "train/grad_norm" in row]
    assert len(norms) == 3 and all(n > 0 for n in norms), norms
    ckpt = run_dir / "checkpoints" / "iter_0000002"
    assert sorted(p.name for p in ckpt.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    # The FSDP2 shards of checkpoints/ convert to HF with no other option (the config from run.json),
    # bit for bit the weights the trainer exported at that save (--save-hf).
    import torch
    from safetensors.torch import load_file

    def weights(d: Path) -> dict:
        return {k: v for f in sorted(d.glob("*.safetensors")) for k, v in load_file(str(f)).items()}

    c = subprocess.run(MILES + ["convert", "--from", "torch_dist", "--to", "hf", "--load", str(run_dir / "checkpoints"),
                                "--save", str(tmp_path / "converted")], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert c.returncode == 0, c.stdout[-3000:] + c.stderr[-3000:]
    got, trained = weights(tmp_path / "converted"), weights(tmp_path / "hf_2")
    assert got.keys() == trained.keys() and [k for k in got if not torch.equal(got[k], trained[k])] == []
    r2 = subprocess.run(MILES + args, cwd=tmp_path, capture_output=True, text=True, timeout=1800)
    assert r2.returncode == 0 and "already complete" in r2.stdout, r2.stdout[-3000:] + r2.stderr[-3000:]
