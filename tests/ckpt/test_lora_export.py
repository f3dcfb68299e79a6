"""`miles convert --lora-export`: a LoRA checkpoint as a merged Hugging Face model (plain transformers
loads it and gives the base+adapter logits) or as a PEFT adapter (PEFT loads it), through the real CLI;
and `miles eval`'s reading of a LoRA checkpoint (merged onto its base)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "backends"))
from backend_fixtures import make_engine_cfg, make_tiny_hf_dir, make_train_data  # noqa: E402

MILES = [sys.executable, "-m", "miles_cli.main"]
TOKENS = torch.tensor([[3, 5, 7, 11, 13, 17, 19, 23, 29, 31]])


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    """A tiny model, one LoRA training rollout, its checkpoint committed under the tracker protocol, and
    the trained model's logits (base + adapter, as the trainer computes them)."""
    from miles.backends.torch import TorchBackend
    from miles.ckpt.trainer_checkpoint import begin_checkpoint, commit_checkpoint
    from miles.train.step import train_rollout

    root = tmp_path_factory.mktemp("lora_export")
    base = make_tiny_hf_dir(root / "base")
    cfg = make_engine_cfg(base, lr=5e-2)
    cfg.lora.lora_rank, cfg.lora.lora_alpha, cfg.lora.target_modules = 4, 8, ["all-linear"]
    t = TorchBackend(cfg, rank=0, world_size=1, device="cpu")
    train_rollout(t, make_train_data(4, seed=1), rollout_id=0)
    tmp = begin_checkpoint(root / "checkpoints", 0)
    t.save_checkpoint(str(tmp))
    commit_checkpoint(root / "checkpoints", 0, tmp, {})
    t.model.eval()
    with torch.no_grad():
        logits = t.model(input_ids=TOKENS).logits
        with t.peft.disable_adapter():
            base_logits = t.model(input_ids=TOKENS).logits
    return root, base, logits, base_logits


def convert(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(MILES + ["convert", *args], cwd=cwd, capture_output=True, text=True, timeout=600)


def test_merged_export_loads_in_plain_transformers_with_the_adapted_logits(lora_run):
    from transformers import AutoModelForCausalLM

    root, base, logits, base_logits = lora_run
    r = convert("--lora-export", "merged", "--load", str(root / "checkpoints"), "--save", str(root / "merged"), cwd=root)
    assert r.returncode == 0, r.stderr[-3000:]
    assert not (root / "merged" / "adapter_config.json").exists()
    model = AutoModelForCausalLM.from_pretrained(str(root / "merged"), dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        merged = model(input_ids=TOKENS).logits
    torch.testing.assert_close(merged, logits, rtol=1e-5, atol=1e-5)
    assert (merged - base_logits).abs().max() > 1e-3, "the export is the base: the adapter was lost"
    again = convert("--lora-export", "merged", "--load", str(root / "checkpoints"), "--save", str(root / "merged"), cwd=root)
    assert again.returncode == 2 and "--force" in again.stderr


def test_adapter_export_loads_with_peft(lora_run):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    root, base, logits, _ = lora_run
    r = convert("--lora-export", "adapter", "--load", str(root / "checkpoints" / "iter_0000000"), "--save", str(root / "adapter"), cwd=root)
    assert r.returncode == 0, r.stderr[-3000:]
    assert {p.name for p in (root / "adapter").iterdir()} >= {"adapter_config.json", "adapter_model.safetensors"}
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32, attn_implementation="eager"), str(root / "adapter"))
    with torch.no_grad():
        out = model.eval()(input_ids=TOKENS).logits
    torch.testing.assert_close(out, logits, rtol=1e-5, atol=1e-5)


def test_a_full_checkpoint_is_refused_in_one_sentence(tmp_path):
    from miles.backends.torch import TorchBackend

    base = make_tiny_hf_dir(tmp_path / "base")
    TorchBackend(make_engine_cfg(base), rank=0, world_size=1, device="cpu").save_checkpoint(str(tmp_path / "full"))
    r = convert("--lora-export", "merged", "--load", str(tmp_path / "full"), "--save", str(tmp_path / "out"), cwd=tmp_path)
    assert r.returncode == 2 and "is not a LoRA checkpoint" in r.stderr and "Traceback" not in r.stderr
    r = convert("--lora-export", "merged", "--from", "torch_dist", "--to", "hf", "--load", str(tmp_path / "full"),
                "--save", str(tmp_path / "out"), cwd=tmp_path)
    assert r.returncode == 2 and "drop --from and --to" in r.stderr


def test_eval_reads_a_lora_checkpoint_as_the_merged_model(lora_run):
    from miles.eval.run import _checkpoint_weights
    from transformers import AutoModelForCausalLM

    root, base, logits, _ = lora_run
    rollout_id, weights = _checkpoint_weights(root / "checkpoints", base)
    assert rollout_id == 0 and not any("lora" in k or "base_layer" in k for k in weights)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32, attn_implementation="eager").eval()
    model.load_state_dict(weights, strict=False)
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=TOKENS).logits, logits, rtol=1e-5, atol=1e-5)
