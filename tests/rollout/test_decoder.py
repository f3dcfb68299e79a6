"""The fast decode forward (`miles.rollout.engine.decoder`) against Hugging Face's forward.

Random small Llama, Qwen2 (q/k/v biases) and Qwen3 (q/k norms) models, random prompts of different
lengths in one batch (so rows sit at different cache columns and rotary positions), a prefill and
then decode steps fed with random tokens: every step's logits must equal HF's full forward of that
row's whole sequence alone. Tolerance: float32 computes the same sums in another order (fused
matmuls, `F.rms_norm`, grouped attention without repeating K/V); with logits of magnitude ~1-10 the
differences seen are 6e-6 to 1e-5 (about 1e-6 relative), so 5e-5 absolute is 5x the observed error yet far below what a wrong
position, a stale weight or a masking error gives (>= 1e-2 on these models).

Also: the HF parameters stay views of the fused matrices through weight updates (so updates reach
the fast path with no copy), a replaced parameter storage is noticed and fused again, tied
embeddings stay tied, and unsupported architectures select Hugging Face's forward in the engine.
"""

from __future__ import annotations

import pytest
import torch

from miles.prepare.tiny_model import build_char_tokenizer
from miles.rollout.engine.base import GenerateRequest, SamplingParams
from miles.rollout.engine.builtin import BuiltinEngine
from miles.rollout.engine.decoder import Decoder, unsupported_reason

torch.set_num_threads(1)
ATOL = 5e-5
VOCAB = 19


def _model(kind: str, seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    common = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )
    torch.manual_seed(seed)
    if kind == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(**common, head_dim=16, tie_word_embeddings=True))
    elif kind == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common, tie_word_embeddings=False))
    else:
        model = LlamaForCausalLM(LlamaConfig(**common, tie_word_embeddings=False, rope_theta=500.0))
    _sharpen(model, seed + 1)
    return model.eval().requires_grad_(False)


def _sharpen(model: torch.nn.Module, seed: int) -> None:
    """Weights at std 0.3 (biases and norms too), so logits differ by O(1) and errors show."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0 if p.dim() == 2 else 1.0, 0.3, generator=g)


def _run(dec: Decoder, prompts: list[list[int]], steps: list[list[int]], src: list[int] | None = None):
    """Prefill `prompts` (rows take prompt src[i]), then feed row i the tokens steps[k][i]; logits per step."""
    src = list(range(len(prompts))) if src is None else src
    width = max(len(p) for p in prompts)
    ids = torch.tensor([p + [0] * (width - len(p)) for p in prompts])
    kv = dec.new_cache()
    kv.ensure(len(src), 4)  # small on purpose: decoding must grow it
    logits = [dec.prefill_into(ids, torch.tensor([len(p) - 1 for p in prompts]), kv, 0, torch.tensor(src))[src]]
    lens = torch.tensor([len(prompts[s]) for s in src])
    for toks in steps:
        kv.ensure(len(src), int(lens.max()) + 1)
        logits.append(dec.decode(torch.tensor(toks), lens, kv, int(lens.max()) + 1))
        lens = lens + 1
    return logits


def _reference(model, prompts, steps, src=None):
    src = list(range(len(prompts))) if src is None else src
    out = []
    for i, s in enumerate(src):
        seq = prompts[s] + [toks[i] for toks in steps]
        full = model(torch.tensor([seq])).logits[0].float()
        out.append(full[len(prompts[s]) - 1 :])
    return [torch.stack([o[k] for o in out]) for k in range(len(steps) + 1)]


@pytest.mark.parametrize("kind", ["qwen3", "qwen2", "llama"])
def test_prefill_and_decode_logits_equal_hf_forward(kind):
    model = _model(kind)
    assert unsupported_reason(model) is None
    dec = Decoder(model)
    g = torch.Generator().manual_seed(3)
    lengths = [1, 7, 3, 12, 5]  # different lengths: rows at different columns and rotary positions
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lengths]
    src = [0, 1, 2, 3, 4, 1, 3]  # two prompts shared by two rows each, as a rollout's samples are
    steps = [torch.randint(0, VOCAB, (len(src),), generator=g).tolist() for _ in range(20)]
    with torch.inference_mode():
        ours = _run(dec, prompts, steps, src)
        ref = _reference(model, prompts, steps, src)
    worst = max((a - b).abs().max().item() for a, b in zip(ours, ref))
    assert worst < ATOL, worst
    assert max(r.abs().max().item() for r in ref) > 1.0  # the comparison is not of near-zero logits


def _new_weights(model, seed):
    fresh = _model(model.config.model_type, seed=seed)
    return list(fresh.state_dict().items()), fresh


def test_weight_updates_reach_the_fast_path_without_a_copy():
    model = _model("qwen3")
    dec = Decoder(model)
    layer = dec.layers[0]
    q = model.model.layers[0].self_attn.q_proj.weight
    # The HF parameter is a view into the fused matrix: same memory.
    assert q.data_ptr() == layer.wqkv.data_ptr()
    sent, fresh = _new_weights(model, seed=7)
    params = dict(model.named_parameters(remove_duplicate=False))
    with torch.no_grad():
        for name, t in sent:  # what BuiltinEngine.update_weights_from_tensors does
            params[name].copy_(t)
    assert layer.current()
    prompts, steps = [[3, 4, 5], [6]], [[7, 8], [9, 10]]
    with torch.inference_mode():
        ours = _run(dec, prompts, steps)
        ref = _reference(fresh, prompts, steps)
    assert max((a - b).abs().max().item() for a, b in zip(ours, ref)) < ATOL
    # Tied embeddings: the output head is the (updated) embedding matrix itself.
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_a_replaced_parameter_storage_is_fused_again():
    model = _model("llama")
    dec = Decoder(model)
    _, fresh = _new_weights(model, seed=9)
    with torch.no_grad():  # what model.to(device) or a zero-copy transport does: new storage per parameter
        for (name, p), (_, new) in zip(model.named_parameters(), fresh.named_parameters()):
            p.data = new.detach().clone()
    assert not dec.layers[0].current()
    dec.ensure_current()
    assert dec.layers[0].current()
    prompts, steps = [[3, 4, 5], [6, 2]], [[7, 8]]
    with torch.inference_mode():
        ours = _run(dec, prompts, steps)
        ref = _reference(fresh, prompts, steps)
    assert max((a - b).abs().max().item() for a, b in zip(ours, ref)) < ATOL


def _save(model, path) -> str:
    model.save_pretrained(path)
    tok = build_char_tokenizer()
    tok.save_pretrained(path)
    return str(path)


def test_unsupported_architectures_run_on_hugging_faces_forward(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=2, n_positions=64,
                                      bos_token_id=1, eos_token_id=2)).eval()
    assert "gpt2" in unsupported_reason(gpt2)
    eng = BuiltinEngine(_save(gpt2, tmp_path / "gpt2"))
    assert eng.decode_path == "hf" and "gpt2" in eng.decode_path_reason
    assert eng.health()["decode_path"] == "hf"
    prompt = [5, 6, 7]
    [resp] = eng.generate([GenerateRequest(prompt, SamplingParams(temperature=0, max_new_tokens=5, stop_token_ids=[]))])
    seq = prompt + resp.output_ids
    with torch.no_grad():
        logits = gpt2(torch.tensor([seq])).logits[0]
    greedy = logits[len(prompt) - 1 : -1].argmax(-1).tolist()
    n = len(resp.output_ids)
    assert resp.output_ids == greedy[:n] and n >= 1
    # A supported model selects the fast path; decode_path="hf" forces Hugging Face's.
    qwen = _save(_model("qwen3"), tmp_path / "qwen3")
    assert BuiltinEngine(qwen).decode_path == "fast"
    assert BuiltinEngine(qwen, decode_path="hf").decode_path == "hf"


@pytest.mark.parametrize("kind", ["qwen3", "llama"])
def test_engine_fast_and_hf_paths_give_the_same_tokens_and_logprobs(tmp_path, kind):
    hf_dir = _save(_model(kind), tmp_path / kind)
    fast, slow = BuiltinEngine(hf_dir, max_batch_size=6), BuiltinEngine(hf_dir, max_batch_size=6, decode_path="hf")
    assert fast.decode_path == "fast"
    g = torch.Generator().manual_seed(5)
    reqs = [
        GenerateRequest(
            torch.randint(3, VOCAB, (int(n),), generator=g).tolist(),
            SamplingParams(temperature=t, top_k=k, max_new_tokens=int(m), seed=i),
            return_logprob=True,
        )
        for i, (n, t, k, m) in enumerate(zip([1, 4, 9, 2, 6, 3, 5, 8, 2, 7], [0, 1, 0.7, 1, 0, 1.3, 1, 0.5, 1, 1],
                                             [-1, -1, 5, -1, -1, 3, -1, -1, -1, 4], [3, 12, 7, 1, 20, 9, 4, 15, 6, 10]))
    ]  # fmt: skip
    a, b = fast.generate(reqs), slow.generate(reqs)  # 10 requests through 6 slots: rows join mid-run
    for x, y in zip(a, b):
        assert (x.output_ids, x.finish_reason) == (y.output_ids, y.finish_reason)
        assert x.output_token_logprobs == pytest.approx(y.output_token_logprobs, abs=1e-5)


@pytest.mark.parametrize("kind", ["qwen3", "llama"])
def test_bfloat16_is_as_close_to_float32_as_hugging_faces_own_bfloat16(kind):
    # bf16 rounds every op (8-bit mantissa): on these sharpened models HF's own bf16 forward is
    # 0.2-0.5 off its float32 logits. The fast path in bf16 must be no further than 1.5x that from
    # float32 (a position or cache error is off by several units).
    m32, m16 = _model(kind), _model(kind).to(torch.bfloat16)
    dec = Decoder(m16)
    assert dec.dtype == torch.bfloat16
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in [1, 7, 3, 12, 5]]
    steps = [torch.randint(0, VOCAB, (5,), generator=g).tolist() for _ in range(10)]
    with torch.inference_mode():
        ours, ref16, ref32 = _run(dec, prompts, steps), _reference(m16, prompts, steps), _reference(m32, prompts, steps)
    hf_err = max((a - b).abs().max().item() for a, b in zip(ref16, ref32))
    our_err = max((a - b).abs().max().item() for a, b in zip(ours, ref32))
    assert our_err <= 1.5 * hf_err, (our_err, hf_err)


def test_the_engine_runs_in_the_dtype_it_is_given(tmp_path):
    hf_dir = _save(_model("qwen3"), tmp_path / "qwen3")
    eng = BuiltinEngine(hf_dir, dtype="bfloat16")
    assert eng.health()["dtype"] == "bfloat16" and eng.decode_path == "fast"
    assert all(p.dtype == torch.bfloat16 for _, p in eng.named_parameters())
    [resp] = eng.generate([GenerateRequest([5, 6, 7], SamplingParams(max_new_tokens=6, seed=1), return_logprob=True)])
    assert len(resp.output_ids) >= 1 and all(lp <= 0 for lp in resp.output_token_logprobs)
