"""The trainer scores the policy the engine sampled from: log-probs and entropy at --rollout-temperature.

Real output of the built-in engine (sampled at T = 0.7, top-k/top-p off) goes through the trainer's
forward; its log-probs must equal the engine's per token within 1e-5 (two implementations: KV-cached
incremental decoding vs one packed/padded forward, so not bit-exact). Scoring the same tokens at T = 1,
what the trainer did before, is off by far more, which shows the check has power.
"""

from __future__ import annotations

import pytest
import torch
from backend_fixtures import make_engine_cfg

from miles.algo.entropy import entropy_from_logits
from miles.train.packing import pack_samples
from miles.backends.torch.forward import scale_logits_by_temperature
from miles.backends.torch.trainer import TorchBackend
from miles.prepare.tiny_model import create_tiny_qwen3
from miles.rollout.engine.base import GenerateRequest, SamplingParams
from miles.rollout.engine.builtin import BuiltinEngine

T = 0.7


@pytest.fixture(scope="module")
def sharp_hf_dir(tmp_path_factory) -> str:
    """The tiny Qwen3 with its matrices redrawn at std 0.3, so the distributions are far from uniform
    and a temperature changes the log-probs a lot."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base = create_tiny_qwen3(tmp_path_factory.mktemp("tiny") / "hf", seed=0)
    model = AutoModelForCausalLM.from_pretrained(base)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.3, generator=g)
    out = tmp_path_factory.mktemp("sharp")
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(base).save_pretrained(out)
    return str(out)


def _engine_rollout(hf_dir: str, temperature: float, **sp) -> dict:
    engine = BuiltinEngine(hf_dir, seed=0, max_batch_size=64)
    prompts = [f"{a}+{b}=" for a in range(4) for b in range(6)]
    reqs = [
        GenerateRequest(engine.tokenizer(p)["input_ids"], SamplingParams(temperature=temperature, max_new_tokens=8, seed=i, **sp),
                        return_logprob=True)
        for i, p in enumerate(prompts)
    ]
    data = {"tokens": [], "response_lengths": [], "loss_masks": [], "engine": []}
    for req, resp in zip(reqs, engine.generate(reqs)):
        if not resp.output_ids:
            continue
        data["tokens"].append(list(req.input_ids) + list(resp.output_ids))
        data["response_lengths"].append(len(resp.output_ids))
        data["loss_masks"].append([1] * len(resp.output_ids))
        data["engine"].append(torch.tensor(resp.output_token_logprobs))
    assert sum(data["response_lengths"]) >= 50
    return data


def _max_diff(hf_dir: str, temperature: float, data: dict) -> float:
    backend = TorchBackend(make_engine_cfg(hf_dir, temperature=temperature, micro_batch_size=5))
    batch = pack_samples(data, range(len(data["tokens"])), "cpu")
    ours, _ = backend.compute_log_probs(batch)
    return float((ours - torch.cat(data["engine"])).abs().max())


def test_trainer_log_probs_equal_the_engines_at_the_rollout_temperature(sharp_hf_dir):
    data = _engine_rollout(sharp_hf_dir, T)
    assert _max_diff(sharp_hf_dir, T, data) <= 1e-5
    # The bug this guards: scoring T-samples with the T = 1 policy.
    assert _max_diff(sharp_hf_dir, 1.0, data) > 1e-2


def test_greedy_rollouts_are_scored_at_temperature_one(sharp_hf_dir):
    # --rollout-temperature 0: the engine reports log_softmax(logits) of the argmax token.
    data = _engine_rollout(sharp_hf_dir, 0.0)
    assert _max_diff(sharp_hf_dir, 0.0, data) <= 1e-5


def test_entropy_is_the_entropy_of_the_tempered_distribution(sharp_hf_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(sharp_hf_dir, dtype=torch.float32, attn_implementation="eager").eval()
    tokens, r = [5, 9, 4, 7, 11, 3], 3
    backend = TorchBackend(make_engine_cfg(sharp_hf_dir, temperature=T))
    batch = pack_samples({"tokens": [tokens], "response_lengths": [r], "loss_masks": [[1] * r]}, [0], "cpu")
    lp, ent = backend.compute_log_probs(batch, with_entropy=True)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([tokens])).logits[0, len(tokens) - r - 1 : len(tokens) - 1].double()
    p = torch.softmax(logits / T, dim=-1)
    torch.testing.assert_close(ent, -(p * p.log()).sum(-1).float(), rtol=0, atol=1e-5)
    torch.testing.assert_close(lp, p.log()[torch.arange(r), torch.tensor(tokens[-r:])].float(), rtol=0, atol=1e-5)
    # At T = 1 the same positions have a clearly different entropy.
    assert (ent - entropy_from_logits(logits.float())).abs().max() > 1e-2


def test_scale_logits_by_temperature():
    x = torch.tensor([[1.0, -2.0, 0.5]])
    torch.testing.assert_close(scale_logits_by_temperature(x, 0.5), torch.tensor([[2.0, -4.0, 1.0]]))
    assert scale_logits_by_temperature(x, 1.0) is x and scale_logits_by_temperature(x, 0.0) is x
    with pytest.raises(ValueError, match="temperature"):
        scale_logits_by_temperature(x, -1.0)
