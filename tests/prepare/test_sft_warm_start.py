"""The SFT warm start: it learns the answer (loss on answer tokens), same bytes per seed, atomic, skipped."""

from __future__ import annotations

import json

import pytest
import torch

from miles.errors import UserError
from miles.prepare import is_complete
from miles.prepare.sft_warm_start import sft_warm_start
from miles.prepare.tiny_model import create_tiny_qwen3

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("sft")
    base = create_tiny_qwen3(root / "base", hidden_size=32, heads=2, kv_heads=1, intermediate=64, seed=0)
    data = root / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in [{"input": "12+3=", "label": "15"}, {"input": "4+4=", "label": "8"}]))
    return root, base, data


def answer_logprob(model_dir, prompt: str, answer: str) -> float:
    """Sum of log p(answer + <|eos|> | prompt) under the model in `model_dir`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    p = tok.encode(prompt, add_special_tokens=False)
    a = tok.encode(answer, add_special_tokens=False) + [tok.eos_token_id]
    with torch.no_grad():
        logp = model(torch.tensor([p + a])).logits.log_softmax(-1)[0]
    return sum(logp[len(p) - 1 + i, t].item() for i, t in enumerate(a))


def test_training_raises_the_answer_probability_and_is_deterministic(setup):
    root, base, data = setup
    out = sft_warm_start(base_model=str(base), data=str(data), out_dir=str(root / "a"), steps=20, batch_size=4, seed=0)
    assert is_complete(out)
    before, after = answer_logprob(base, "12+3=", "15"), answer_logprob(out, "12+3=", "15")
    assert after > before + 1.0, (before, after)
    again = sft_warm_start(base_model=str(base), data=str(data), out_dir=str(root / "b"), steps=20, batch_size=4, seed=0)
    assert (again / "model.safetensors").read_bytes() == (out / "model.safetensors").read_bytes()
    # The tokenizer travels with the weights, so the engine can load the directory alone.
    assert (out / "tokenizer.json").read_bytes() == (base / "tokenizer.json").read_bytes()


def test_skipped_when_complete_and_rejects_other_arguments(setup):
    root, base, data = setup
    kwargs = dict(base_model=str(base), data=str(data), out_dir=str(root / "c"), steps=2, batch_size=2, seed=0)
    out = sft_warm_start(**kwargs)
    mtime = (out / "model.safetensors").stat().st_mtime_ns
    assert sft_warm_start(**kwargs) == out and (out / "model.safetensors").stat().st_mtime_ns == mtime
    with pytest.raises(UserError, match="already holds"):
        sft_warm_start(**(kwargs | {"steps": 3}))


def test_empty_data_is_a_user_error_and_leaves_nothing(setup):
    root, base, _ = setup
    empty = root / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(UserError, match="holds no rows"):
        sft_warm_start(base_model=str(base), data=str(empty), out_dir=str(root / "e" / "sft"), steps=2, seed=0)
    assert list((root / "e").iterdir()) == []
