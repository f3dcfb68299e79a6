"""The tiny Qwen3 prepare step: loads with Auto*, deterministic bytes, atomic and skipped when complete."""

from __future__ import annotations

import json

import pytest
import torch

from miles.errors import UserError
from miles.prepare import SENTINEL, is_complete
from miles.prepare.arith_task import all_problems
from miles.prepare.tiny_model import TASK_CHARS, create_tiny_qwen3

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return create_tiny_qwen3(tmp_path_factory.mktemp("t") / "hf", seed=0)


def test_loads_with_auto_classes_and_has_the_baseline_size(tiny):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny)
    cfg = model.config
    assert cfg.model_type == "qwen3" and cfg.vocab_size == 4 + len(TASK_CHARS) == 19
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (64, 2, 4, 2)
    # By hand: embed 19*64 = 1216 (tied with lm_head); per layer q 4096 + k 2048 + v 2048 + o 4096
    # + q/k norm 16+16 + MLP 3*64*256 = 49152 + 2 norms 128 = 61600; final norm 64.
    assert sum(p.numel() for p in model.parameters()) == 1216 + 2 * 61600 + 64 == 124480
    assert model.generation_config.eos_token_id == 2 and model.generation_config.pad_token_id == 0


def test_tokenizer_round_trips_every_task_string(tiny):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny)
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, tok.unk_token_id) == (0, 1, 2, 3)
    assert tok.padding_side == "left"
    for row in all_problems(["+", "-", "*"], 9):
        text = row["input"] + row["label"]
        ids = tok(text)["input_ids"]
        assert len(ids) == len(text) and tok.unk_token_id not in ids  # one token per character
        assert tok.decode(ids) == text
    assert tok("1 +2")["input_ids"] == [5, 18, 14, 6]  # '1'=4+1, ' '=4+14, '+'=4+10, '2'=4+2
    assert tok.decode([9, 17, 2], skip_special_tokens=True) == "5="
    assert tok.decode([9, 17, 2]) == "5=<|eos|>"
    assert tok("a")["input_ids"] == [3]  # outside the task's characters: <|unk|>


def test_same_seed_same_bytes_other_seed_other_weights(tiny, tmp_path):
    again = create_tiny_qwen3(tmp_path / "again", seed=0)
    other = create_tiny_qwen3(tmp_path / "other", seed=1)
    for name in ("model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (again / name).read_bytes() == (tiny / name).read_bytes(), name
    assert (other / "model.safetensors").read_bytes() != (tiny / "model.safetensors").read_bytes()


def test_global_rng_is_left_alone(tmp_path):
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    create_tiny_qwen3(tmp_path / "m", seed=5)
    assert torch.equal(torch.rand(3), expected)


def test_sentinel_last_skip_when_complete_and_reject_other_arguments(tiny, tmp_path):
    assert is_complete(tiny)
    assert json.loads((tiny / SENTINEL).read_text())["seed"] == 0
    before = (tiny / "model.safetensors").stat().st_mtime_ns
    assert create_tiny_qwen3(tiny, seed=0) == tiny
    assert (tiny / "model.safetensors").stat().st_mtime_ns == before  # skipped, not rebuilt
    with pytest.raises(UserError, match="delete that directory"):
        create_tiny_qwen3(tiny, seed=1)
    # No temporary directories are left next to it.
    assert [p.name for p in tiny.parent.iterdir()] == [tiny.name]


def test_an_interrupted_directory_is_rebuilt(tmp_path):
    out = tmp_path / "hf"
    out.mkdir()
    (out / "config.json").write_text("{half written")  # no sentinel: a killed earlier run
    create_tiny_qwen3(out, seed=0)
    assert is_complete(out) and json.loads((out / "config.json").read_text())["model_type"] == "qwen3"


def test_a_failed_build_leaves_nothing(tmp_path, monkeypatch):
    from transformers import PreTrainedTokenizerFast

    def boom(self, *a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(PreTrainedTokenizerFast, "save_pretrained", boom)
    with pytest.raises(OSError, match="disk full"):
        create_tiny_qwen3(tmp_path / "hf", seed=0)
    assert list(tmp_path.iterdir()) == []
