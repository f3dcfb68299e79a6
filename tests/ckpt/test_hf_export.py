"""HF export: `AutoModelForCausalLM.from_pretrained` loads what `export_hf` wrote, with the same logits."""

from __future__ import annotations

import json
import os

import pytest
import torch

from miles.ckpt.hf_export import export_hf

torch.set_num_threads(1)


def tiny_model(path, *, tie: bool):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(
        vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=64, tie_word_embeddings=tie,
        attn_implementation="eager",  # the loaded copy runs eager too: same kernels, comparable bit for bit
    )
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(cfg).eval()
    model.save_pretrained(str(path))
    (path / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 64}))
    return model


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=torch.tensor([[3, 7, 11, 5, 9]])).logits


def load(path, **kw):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), attn_implementation="eager", **kw).eval()


@pytest.mark.parametrize("tie", [False, True])
def test_export_loads_with_bit_equal_weights_and_logits(tmp_path, tie):
    src = tmp_path / "src"
    model = tiny_model(src, tie=tie)
    with torch.no_grad():  # "train" it, so the export cannot pass by copying the source weights
        for p in model.parameters():
            p.add_(0.01)
    out = export_hf(model, src, tmp_path / "out")
    assert out == tmp_path / "out"
    assert sorted(os.listdir(out)) == sorted(["config.json", "generation_config.json", "model.safetensors", "tokenizer_config.json"])
    loaded = load(out)
    for name, t in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], t), name
    assert torch.equal(logits(loaded), logits(model))
    assert not torch.equal(logits(loaded), logits(load(src)))
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name or ".old-" in p.name]


def test_named_tensor_iterable_sharding_and_replacement(tmp_path):
    src = tmp_path / "src"
    model = tiny_model(src, tie=False)
    out = tmp_path / "out"
    out.mkdir()
    (out / "stale.txt").write_text("from an older export")
    export_hf(iter(model.state_dict().items()), src, out, max_shard_bytes=20_000)
    names = os.listdir(out)
    assert "stale.txt" not in names  # the whole directory was replaced
    shards = sorted(n for n in names if n.endswith(".safetensors"))
    assert len(shards) > 1 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(model.state_dict())
    assert torch.equal(logits(load(out)), logits(model))


def test_bf16_export_declares_its_dtype(tmp_path):
    src = tmp_path / "src"
    model = tiny_model(src, tie=False)
    out = export_hf(model, src, tmp_path / "out", dtype=torch.bfloat16)
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    loaded = load(out, dtype="auto")
    assert loaded.model.embed_tokens.weight.dtype == torch.bfloat16
    assert torch.equal(loaded.model.embed_tokens.weight, model.model.embed_tokens.weight.to(torch.bfloat16))


def test_source_without_config_is_rejected(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        export_hf({"w": torch.zeros(1)}, tmp_path, tmp_path / "out")


def test_a_killed_export_is_cleaned_by_the_next_one_and_a_live_ones_temp_is_kept(tmp_path):
    """A real SIGKILL in the middle of an export leaves `<out>.tmp-<pid>`; the next export removes it."""
    import signal
    import subprocess
    import sys
    import textwrap

    src = tmp_path / "src"
    tiny_model(src, tie=False)
    script = textwrap.dedent(
        f"""
        import os, signal, torch
        import miles.ckpt.hf_export as hx
        def die(*a, **k):
            os.kill(os.getpid(), signal.SIGKILL)
        import safetensors.torch
        safetensors.torch.save_file = die  # killed while writing the weights
        hx.export_hf({{"w": torch.ones(3)}}, {str(src)!r}, {str(tmp_path / "hf_3")!r})
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], timeout=120)
    assert proc.returncode == -signal.SIGKILL
    left = [p for p in tmp_path.iterdir() if p.name.startswith("hf_3.tmp-")]
    assert len(left) == 1 and (left[0] / "config.json").is_file()  # the kill left a partial export
    live = tmp_path / f"hf_9.tmp-{os.getppid()}"  # a writer that is still running (the pytest parent)
    live.mkdir()
    export_hf({"model.embed_tokens.weight": torch.ones(32, 32)}, src, tmp_path / "hf_4")
    assert not left[0].exists()
    assert live.exists()
