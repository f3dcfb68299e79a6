"""`miles convert --from torch_dist --to hf` takes the checkpoints the torch trainer writes (issue 28).

A run's `checkpoints/` (tracker → latest complete iteration), one `iter_*` of it, or `--ckpt-step N`;
the HF config comes from the run's `run.json` (its `--hf-checkpoint`), and the weights written are
the trainer's, bit for bit. Through the program, as a user runs it. (The default run's, an FSDP2 run's
and a megatron TP=2 run's own checkpoints are converted in tests/e2e.)

Run: pytest tests/ckpt/test_convert_training_checkpoints.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "backends"))
from backend_fixtures import make_engine_cfg, make_tiny_hf_dir, make_train_data  # noqa: E402

from miles.backends.torch import TorchBackend  # noqa: E402
from miles.ckpt.trainer_checkpoint import begin_checkpoint, commit_checkpoint  # noqa: E402
from miles.train.step import train_rollout  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
torch.set_num_threads(1)


def miles(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "NO_COLOR": "1", "COLUMNS": "200"}
    return subprocess.run([sys.executable, "-m", "miles_cli.main", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def hf_weights(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in sorted(directory.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> tuple[Path, dict[int, dict[str, torch.Tensor]], str]:
    """A run directory as the driver leaves it: run.json, checkpoints/iter_0000000 and iter_0000001."""
    root = tmp_path_factory.mktemp("run")
    hf = make_tiny_hf_dir(root / "hf")
    (Path(hf) / "tokenizer_config.json").write_text("{}\n")  # stands for the tokenizer files copied along
    run = root / "runs" / "r"
    trainer = TorchBackend(make_engine_cfg(hf, lr=1e-2), rank=0, world_size=1, device="cpu")
    saved = {}
    for rollout_id in (0, 1):
        train_rollout(trainer, make_train_data(4, seed=rollout_id), rollout_id=rollout_id)
        tmp = begin_checkpoint(run / "checkpoints", rollout_id)
        trainer.save_checkpoint(str(tmp))
        commit_checkpoint(run / "checkpoints", rollout_id, tmp, {"data_position": rollout_id})
        saved[rollout_id] = {n: t.detach().clone() for n, t in trainer.model.state_dict().items()}
    (run / "run.json").write_text(json.dumps({"run_id": "r", "identity": {"hf_checkpoint": str(Path(hf).absolute())}}))
    return run, saved, hf


@pytest.mark.parametrize("load, step, extra", [
    ("checkpoints", 1, []),                     # the tracker's latest
    ("checkpoints/iter_0000000", 0, []),        # one iteration directory
    ("checkpoints", 0, ["--ckpt-step", "0"]),   # an older one by step
])
def test_a_torch_training_checkpoint_converts_bit_exact_with_the_config_from_the_run_record(run_dir, tmp_path, load, step, extra):
    run, saved, _hf = run_dir
    r = miles(["convert", "--from", "torch_dist", "--to", "hf", "--load", str(run / load), "--save", str(tmp_path / "out"), *extra], tmp_path)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    got = hf_weights(tmp_path / "out")
    assert got.keys() == saved[step].keys()
    for name, tensor in saved[step].items():
        assert torch.equal(got[name], tensor), name
    assert (tmp_path / "out" / "config.json").is_file() and (tmp_path / "out" / "tokenizer_config.json").is_file()
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32)
    assert torch.equal(model.model.embed_tokens.weight, saved[step]["model.embed_tokens.weight"])


def test_without_a_run_record_one_sentence_names_origin_hf_dir(run_dir, tmp_path):
    run, _saved, hf = run_dir
    bare = tmp_path / "elsewhere"
    import shutil

    shutil.copytree(run / "checkpoints", bare)
    r = miles(["convert", "--from", "torch_dist", "--to", "hf", "--load", str(bare), "--save", str(tmp_path / "out")], tmp_path)
    assert r.returncode == 2 and "--origin-hf-dir" in r.stdout + r.stderr and "Traceback" not in r.stderr, r.stdout + r.stderr
    assert not (tmp_path / "out").exists()
    r = miles(["convert", "--from", "torch_dist", "--to", "hf", "--load", str(bare), "--origin-hf-dir", hf, "--save", str(tmp_path / "out")], tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]


def test_a_step_that_was_not_saved_is_refused_naming_the_saved_ones(run_dir, tmp_path):
    run, _saved, _hf = run_dir
    r = miles(["convert", "--from", "torch_dist", "--to", "hf", "--load", str(run / "checkpoints"), "--ckpt-step", "7",
               "--save", str(tmp_path / "out")], tmp_path)
    out = r.stdout + r.stderr
    assert r.returncode == 2 and "--ckpt-step 7" in out and "0, 1" in out and "Traceback" not in out, out
