"""End to end through the real CLI: prepare, the Ray loop, checkpoints, resume, tracking outputs.

`--mode debug_minimal` runs the whole control flow in a few steps (2 SFT steps, 3 rollouts) with
--check-weight-update-equal on, so every weight sync is verified against the trainer. The resume
tests start from the recipe's full SFT warm start (cached, tests/conftest.py `warm_start`), where
rewards vary: they assert that every step had a non-zero gradient and that the weights moved, so a
bit-identical resume compares trained states with non-zero Adam moments, not untouched weights. The
slow test runs the default recipe and checks that it learns.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tests.e2e.kill import sigkill_once_exists

MILES = [sys.executable, "-m", "miles_cli.main"]


def run(args: list[str], cwd: Path, timeout: int = 600) -> subprocess.CompletedProcess:
    r = subprocess.run(MILES + args, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, f"miles {' '.join(args)} failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("e2e")


def dirs(work: Path, run_id: str) -> list[str]:
    return ["--model-dir", str(work / "models"), "--data-dir", str(work / "data"), "--output-dir", str(work / "runs"), "--run-id", run_id]


def warm(warm_start, work: Path, run_id: str) -> list[str]:
    """Like `dirs`, but on the cached warm start: its model and data directories, the full SFT step count."""
    return ["--model-dir", str(warm_start.model_dir), "--data-dir", str(warm_start.data_dir), "--sft-steps", "375",
            "--output-dir", str(work / "runs"), "--run-id", run_id]


def assert_trained(run_dir: Path, warm_start) -> None:
    """Every rollout had a non-zero gradient and the final weights differ from the warm start."""
    from safetensors.torch import load_file

    norms = [r["train/grad_norm"] for r in rows(run_dir) if "train/grad_norm" in r]
    assert norms and all(n > 0 for n in norms), f"a step without gradient: {norms}"
    final, initial = final_state(run_dir)["model"], load_file(str(warm_start.sft_model / "model.safetensors"))
    assert max((final[k] - initial[k]).abs().max().item() for k in initial) > 1e-5, "the weights never moved"


def rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def steps_logged(run_dir: Path) -> list[int]:
    return sorted({row["step"] for row in rows(run_dir)})


def eval_steps(run_dir: Path) -> list[int]:
    return sorted({row["step"] for row in rows(run_dir) if "eval/arith/accuracy" in row})


def final_state(run_dir: Path) -> dict:
    ckpt = run_dir / "checkpoints"
    it = (ckpt / "latest_checkpointed_iteration.txt").read_text().strip()
    path = next((ckpt / p for p in [f"iter_{int(it):07d}"] if (ckpt / p).exists()))
    from miles.backends.torch.checkpoint import read_model_weights

    return {"model": read_model_weights(str(path))}


def adam_second_moments(run_dir: Path) -> dict:
    """The `exp_avg_sq` tensors of the run's latest (per-rank DCP) checkpoint, read in this process."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    ckpt = run_dir / "checkpoints"
    path = str(ckpt / f"iter_{int((ckpt / 'latest_checkpointed_iteration.txt').read_text().strip()):07d}")
    meta = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    out = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in meta.items()
           if k.endswith("exp_avg_sq") and isinstance(m, TensorStorageMetadata)}
    dcp.load(out, checkpoint_id=path, no_dist=True)
    return out


def test_debug_minimal_runs_the_whole_loop_and_resumes(work):
    r = run(["full-train", "--mode", "debug_minimal", *dirs(work, "smoke")], work)
    run_dir = work / "runs" / "smoke"
    assert steps_logged(run_dir) == [0, 1, 2, 3]  # eval before training, then 3 rollouts
    for name in ["metrics.jsonl", "mlflow.db", "curves.png", "checkpoints/latest_checkpointed_iteration.txt"]:
        assert (run_dir / name).exists(), name
    assert "Plot:" in r.stdout
    # The plot is an artifact of the run's MLflow run, stored in the run directory.
    from mlflow.tracking import MlflowClient

    mlflow_id = (run_dir / "mlflow_run_id.txt").read_text().strip()
    client = MlflowClient(tracking_uri=f"sqlite:///{(run_dir / 'mlflow.db').resolve()}")
    assert [a.path for a in client.list_artifacts(mlflow_id)] == ["curves.png"]
    assert list((run_dir / "mlflow_artifacts").rglob("curves.png")) and not (work / "mlruns").exists()  # not in the cwd
    # One metrics line per step, every metric of the step in it (issue 28).
    assert [row["step"] for row in rows(run_dir)] == [0, 1, 2, 3]
    assert "eval/step" not in {k for row in rows(run_dir) for k in row}
    # A quiet console: Ray's notice that token authentication is on (its default) is not the user's business.
    assert "Token authentication is enabled" not in r.stdout + r.stderr
    # ... nor torch.distributed.checkpoint's warning that a one-worker save is a single process.
    assert "assuming the intent is to" not in r.stdout + r.stderr
    # ... nor MLflow's set-up of a new sqlite store.
    assert "Creating initial MLflow database tables" not in r.stdout + r.stderr
    # The recipe samples at T = 0.8; the trainer scores at the same temperature, so its log-probs equal
    # the engine's up to float noise (at T = 1 they differed by 0.07-0.09 per token).
    diffs = [row["train/train_rollout_logprob_abs_diff"] for row in rows(run_dir) if "train/train_rollout_logprob_abs_diff" in row]
    assert len(diffs) == 3 and max(diffs) < 1e-4, diffs
    # The same command again: prepare steps are skipped and the finished run resumes at its end.
    r2 = run(["full-train", "--mode", "debug_minimal", *dirs(work, "smoke")], work)
    assert "already complete" in r2.stdout
    assert "The run finished at rollout 2" in r2.stdout and "nothing to train" in r2.stdout


def assert_converts_to_the_trainer_weights(checkpoints: Path, reference: dict, cwd: Path) -> None:
    """`miles convert` of a run's own checkpoints/ (no other option) gives these weights, bit for bit."""
    from safetensors.torch import load_file

    out = cwd / f"hf_of_{checkpoints.parent.name}"
    run(["convert", "--from", "torch_dist", "--to", "hf", "--load", str(checkpoints), "--save", str(out)], cwd)
    got = {k: v for f in sorted(out.glob("*.safetensors")) for k, v in load_file(str(f)).items()}
    if json.loads((out / "config.json").read_text()).get("tie_word_embeddings"):
        # A tied lm_head is the embedding; Hugging Face saves it once, so does convert.
        assert torch.equal(reference["lm_head.weight"], reference["model.embed_tokens.weight"])
        reference = {k: v for k, v in reference.items() if k != "lm_head.weight"}
    assert got.keys() == reference.keys()
    assert [k for k in reference if not torch.equal(got[k], reference[k])] == []
    assert (out / "config.json").is_file() and (out / "tokenizer.json").is_file()


def test_the_runs_own_checkpoints_convert_to_hf_bit_exact(work):
    """The default run's `checkpoints/` (torch backend, per-rank DCP) → HF, the config from its run.json."""
    run_dir = work / "runs" / "smoke"
    if not (run_dir / "checkpoints").exists():
        run(["full-train", "--mode", "debug_minimal", *dirs(work, "smoke")], work)
    assert_converts_to_the_trainer_weights(run_dir / "checkpoints", final_state(run_dir)["model"], work)


def test_eval_of_the_final_checkpoint_equals_the_runs_last_eval(work):
    """`miles eval --checkpoint <run>/checkpoints` loads the trainer weights into a fresh engine."""
    run_dir = work / "runs" / "smoke"
    if not (run_dir / "checkpoints").exists():
        run(["full-train", "--mode", "debug_minimal", *dirs(work, "smoke")], work)
    last = [r for r in rows(run_dir) if "eval/arith/accuracy" in r][-1]
    run(["eval", "--mode", "debug_minimal", *dirs(work, "smoke"), "--checkpoint", str(run_dir / "checkpoints")], work)
    written = json.loads((run_dir / "eval" / "rollout_2.json").read_text())
    for key in ["eval/arith/accuracy", "eval/arith/reward", "eval/arith/response_len_mean"]:
        assert written[key] == last[key], key


def test_resume_equals_uninterrupted_bit_for_bit(work, warm_start):
    """Train 4 rollouts straight; train 2, stop, rerun to 4: the final trainer states are identical."""
    common = ["--mode", "debug_minimal", "--skip-eval-before-train", "--save-interval", "2"]
    run(["full-train", *common, "--num-rollout", "4", *warm(warm_start, work, "straight")], work)
    run(["full-train", *common, "--num-rollout", "2", *warm(warm_start, work, "resumed")], work)
    # The checkpoint resumed from holds Adam moments of real gradients.
    moments = adam_second_moments(work / "runs" / "resumed")
    assert moments and any(float(t.abs().max()) > 0 for t in moments.values()), "resuming from zero Adam moments"
    r = run(["full-train", *common, "--num-rollout", "4", *warm(warm_start, work, "resumed")], work)
    assert "Resumed from the checkpoint of rollout 1" in r.stdout
    assert_trained(work / "runs" / "straight", warm_start)
    a, b = final_state(work / "runs" / "straight"), final_state(work / "runs" / "resumed")
    assert a["model"].keys() == b["model"].keys()
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    ea = [r["rollout/raw_reward"] for r in rows(work / "runs/straight") if "rollout/raw_reward" in r]
    eb = [r["rollout/raw_reward"] for r in rows(work / "runs/resumed") if "rollout/raw_reward" in r]
    assert ea == eb and len(ea) == 4


@pytest.mark.slow
@pytest.mark.timeout(1500)  # above the run's own 1200 s limit (the suite's default is 900 s)
def test_default_full_train_learns(work):
    r = run(["full-train", *dirs(work, "default")], work, timeout=1200)
    logged = rows(work / "runs/default")
    evals = [row["eval/arith/accuracy"] for row in logged if "eval/arith/accuracy" in row]
    rewards = [row["rollout/raw_reward"] for row in logged if "rollout/raw_reward" in row]
    assert sum(rewards[-20:]) / 20 > sum(rewards[:20]) / 20 + 0.1, "training reward did not climb"
    # Issue 4's bar: held-out greedy accuracy after RL at least 0.2 above the SFT warm start (step-0 eval).
    assert evals[-1] >= evals[0] + 0.2, r.stdout[-2000:]
    diffs = [row["train/train_rollout_logprob_abs_diff"] for row in logged if "train/train_rollout_logprob_abs_diff" in row]
    assert max(diffs) < 1e-4, max(diffs)  # trainer and engine score the same (T = 0.8) policy
    assert "before training" in r.stdout and "Plot:" in r.stdout


def test_sigkill_after_a_checkpoint_then_rerun_resumes_and_matches(work, warm_start):
    """SIGKILL the whole run once a checkpoint exists; the same command resumes and ends bit-identical."""

    common = ["--mode", "debug_minimal", "--skip-eval-before-train", "--num-rollout", "4"]
    args = ["full-train", *common, "--save-interval", "1", *warm(warm_start, work, "killed")]
    ckpt = work / "runs" / "killed" / "checkpoints"
    sigkill_once_exists(args, work, ckpt / "iter_0000001", timeout=300)
    r = run(args, work)
    resumed_from = int(r.stdout.split("Resumed from the checkpoint of rollout ")[1].split(".")[0])
    assert resumed_from >= 1
    if not (work / "runs" / "straight").exists():
        run(["full-train", *common, "--save-interval", "2", *warm(warm_start, work, "straight")], work)
    assert_trained(work / "runs" / "killed", warm_start)
    a, b = final_state(work / "runs" / "straight"), final_state(work / "runs" / "killed")
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    assert steps_logged(work / "runs" / "killed") == [1, 2, 3, 4]
    assert eval_steps(work / "runs" / "killed") == eval_steps(work / "runs" / "straight") == [2, 4]
    train_rows = lambda name: [r["rollout/raw_reward"] for r in rows(work / "runs" / name) if "rollout/raw_reward" in r]
    assert train_rows("killed") == train_rows("straight")


def test_a_user_error_inside_a_ray_worker_exits_2(work):
    """A bad hook path is found while the rollout manager starts in its Ray actor: exit 2, one sentence."""
    args = ["full-train", "--mode", "debug_minimal", *dirs(work, "bad-hook"), "--dynamic-sampling-filter-path", "no_such_module.fn"]
    r = subprocess.run(MILES + args, cwd=work, capture_output=True, text=True, timeout=600)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "--dynamic-sampling-filter-path" in r.stderr and "Traceback" not in r.stderr
