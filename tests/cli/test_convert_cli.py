"""`miles convert` through the real program (`python -m miles_cli.main convert ...` in a subprocess).

What a user sees: exit codes (0 done or skipped, 2 for a user mistake with one `Error:` line and no
traceback), the progress bar (tensors and bytes), bit-exact HF -> torch_dist -> HF, and that a convert
killed with SIGKILL mid-write leaves nothing that looks complete (and the next run cleans up after it).
"""

from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "ckpt"))
from _mp_models import make_hf_model  # noqa: E402

torch.set_num_threads(1)
ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "COLUMNS": "200", "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


def miles_convert(*args: str, cwd: Path, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "miles_cli.main", "convert", *args], cwd=cwd, env=ENV,
                          capture_output=True, text=True, timeout=timeout)


def test_hf_to_torch_dist_to_hf_with_progress_and_skip(tmp_path):
    model = make_hf_model("qwen3", tmp_path / "hf")
    r = miles_convert("--hf-checkpoint", "hf", "--save", "td", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    # 2-layer tiny Qwen3, untied: embedding + 2 x 8 per layer + final norm + output layer = 19 tensors;
    # 24,768 fp32 parameters = 99,072 bytes.
    assert "hf -> torch_dist" in r.stdout and "19/19 tensors" in r.stdout and "99.1/99.1 kB" in r.stdout, r.stdout
    assert (tmp_path / "td" / "latest_checkpointed_iteration.txt").read_text() == "release"
    assert "Traceback" not in r.stderr and "Warning" not in r.stderr, r.stderr

    stamp = (tmp_path / "td" / "release" / ".metadata").stat().st_mtime_ns
    again = miles_convert("--hf-checkpoint", "hf", "--save", "td", cwd=tmp_path)
    assert again.returncode == 0
    assert f"skipped: {tmp_path / 'td'} is already complete (use --force to convert again)" in again.stderr.replace("\n", "")
    assert (tmp_path / "td" / "release" / ".metadata").stat().st_mtime_ns == stamp

    back = miles_convert("--from", "torch_dist", "--to", "hf", "--load", "td", "--save", "back", cwd=tmp_path)
    assert back.returncode == 0, back.stderr
    assert "19/19 tensors" in back.stdout and "99.1/99.1 kB" in back.stdout, back.stdout
    tensors = load_file(tmp_path / "back" / "model-00001-of-00001.safetensors")
    assert set(tensors) == set(model.state_dict())
    for name, p in model.state_dict().items():
        assert torch.equal(tensors[name], p), name
    assert sorted(p.name for p in tmp_path.iterdir()) == ["back", "hf", "td"]  # no temporary left


def _arch(tmp_path: Path, name: str) -> None:
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    cfg["architectures"] = [name]
    (tmp_path / "hf" / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("args,setup,expected", [
    (["--hf-checkpoint", "missing", "--save", "out"], None, "--hf-checkpoint missing is not a directory"),
    (["--hf-checkpoint", "hf", "--save", "out"], lambda d: _arch(d, "GPT2LMHeadModel"),
     "architecture ['GPT2LMHeadModel'] is not supported by miles convert; supported: LlamaForCausalLM, "
     "Qwen2ForCausalLM, Qwen3ForCausalLM, Qwen3MoeForCausalLM."),
    (["--from", "hf", "--to", "hf", "--hf-checkpoint", "hf", "--save", "out"], None, "--from and --to are both hf"),
    (["--hf-checkpoint", "hf", "--save", "out"], lambda d: (d / "out").mkdir(),
     "exists but is not a complete torch_dist checkpoint; pass --force"),
    (["--from", "torch_dist", "--to", "hf", "--load", "hf", "--save", "out"], None,
     "has no latest_checkpointed_iteration.txt, no metadata.json and no .metadata, so it holds no checkpoint"),
    # A few bytes of text where the weights should be: its "header length" is garbage (issue 28; it
    # used to be allocated, a MemoryError).
    (["--hf-checkpoint", "hf", "--save", "out"], lambda d: (d / "hf" / "model.safetensors").write_text("not weights at all\n"),
     "is not a readable safetensors file (its first 8 bytes give a header of"),
    (["--hf-checkpoint", "hf", "--save", "out"], lambda d: (d / "hf" / "model.safetensors").write_bytes(b"\x02\x00\x00\x00\x00\x00\x00\x00[]"),
     "its header is not a JSON object"),
], ids=["missing-dir", "unknown-architecture", "same-from-to", "existing-output", "load-not-torch-dist", "text-as-safetensors",
        "header-not-an-object"])
def test_user_errors_exit_2_with_one_sentence(tmp_path, args, setup, expected):
    make_hf_model("llama", tmp_path / "hf")
    if setup:
        setup(tmp_path)
    before = sorted(p.name for p in tmp_path.iterdir())
    r = miles_convert(*args, cwd=tmp_path)
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr and len(lines) == 1 and lines[0].startswith("Error: "), r.stderr
    assert expected in lines[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing written


def _large_qwen3(d: Path, layers: int = 2) -> None:
    """A ~260 MB fp32 Qwen3 checkpoint (zeros: only its size matters), written without a model object."""
    h, ffn, vocab, heads, kv, hd = 1024, 4096, 16384, 16, 8, 64
    d.mkdir()
    (d / "config.json").write_text(json.dumps({
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": h, "intermediate_size": ffn,
        "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": hd,
        "vocab_size": vocab, "rms_norm_eps": 1e-6, "rope_theta": 1e6, "tie_word_embeddings": False}))
    t = {"model.embed_tokens.weight": (vocab, h), "lm_head.weight": (vocab, h), "model.norm.weight": (h,)}
    for i in range(layers):
        p = f"model.layers.{i}."
        t |= {p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
              p + "self_attn.q_proj.weight": (heads * hd, h), p + "self_attn.k_proj.weight": (kv * hd, h),
              p + "self_attn.v_proj.weight": (kv * hd, h), p + "self_attn.o_proj.weight": (h, heads * hd),
              p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,),
              p + "mlp.gate_proj.weight": (ffn, h), p + "mlp.up_proj.weight": (ffn, h), p + "mlp.down_proj.weight": (h, ffn)}
    save_file({k: torch.zeros(s) for k, s in t.items()}, d / "model.safetensors")


def test_sigkill_mid_write_leaves_nothing_complete_and_the_rerun_cleans_up(tmp_path):
    _large_qwen3(tmp_path / "hf")
    cmd = [sys.executable, "-m", "miles_cli.main", "convert", "--hf-checkpoint", "hf", "--save", "td"]
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    try:
        # Kill once the writer has put tensor bytes on disk (it is mid-write, metadata not yet written).
        while not [f for f in glob.glob(str(tmp_path / ".td.tmp-*" / "release" / "*.distcp")) if os.path.getsize(f) > 0]:
            assert proc.poll() is None, f"convert ended before it could be killed: {proc.stderr.read().decode()}"
            assert time.monotonic() < deadline, "timed out waiting for the convert to start writing tensors"
            time.sleep(0.02)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == -signal.SIGKILL
    left = sorted(p.name for p in tmp_path.iterdir())
    assert len(left) == 2 and left[1] == "hf" and left[0].startswith(".td.tmp-"), left  # only the hidden temporary
    stale = left[0]
    assert not (tmp_path / "td").exists()
    assert not list(tmp_path.rglob("latest_checkpointed_iteration.txt"))
    assert not list(tmp_path.rglob("metadata.json"))  # megatron-core's "this is a checkpoint" marker

    r = miles_convert("--hf-checkpoint", "hf", "--save", "td", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert f"removed {stale}, left by an interrupted conversion (process {proc.pid} is gone)" in r.stderr.replace("\n", "")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "td"]
    assert (tmp_path / "td" / "latest_checkpointed_iteration.txt").read_text() == "release"
