"""The built-in engine against references: HF `generate`, a full forward pass, itself one-by-one.

The model is the tiny Qwen3 with its matrices redrawn at std 0.3 so greedy outputs are varied (the
default init at std 0.02 makes every logit nearly equal and every answer the same token), and about
half of the 100 "a+b=" prompts end in <|eos|> within 8 tokens.
"""

from __future__ import annotations

import threading

import pytest
import torch

from miles.prepare.tiny_model import create_tiny_qwen3
from miles.rollout.engine.base import GenerateRequest, SamplingParams, iter_weight_buckets, weights_checksum
from miles.rollout.engine.builtin import (
    _GOLDEN,
    BatchParams,
    BuiltinEngine,
    _apply_top_k,
    _apply_top_p,
    mix64,
    sample_next,
    uniform_noise,
)

torch.set_num_threads(1)

EOS = 2
PROMPTS = [f"{a}+{b}=" for a in range(10) for b in range(10)] + ["12+3=", "7=", "9*9-81="]


def _sharpen(model: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.3, generator=g)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> str:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base = create_tiny_qwen3(tmp_path_factory.mktemp("tiny") / "hf", seed=0)
    model = AutoModelForCausalLM.from_pretrained(base)
    _sharpen(model, seed=1)
    out = tmp_path_factory.mktemp("sharp")
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(base).save_pretrained(out)
    return str(out)


# Every engine test runs on both decode paths: "auto" picks the fast decoder for this Qwen3 model,
# "hf" is Hugging Face's forward, which every other architecture uses.
@pytest.fixture(scope="module", params=["auto", "hf"])
def path(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def engine(hf_dir, path) -> BuiltinEngine:
    return BuiltinEngine(hf_dir, seed=0, max_batch_size=64, decode_path=path)


@pytest.fixture(scope="module")
def hf_model(hf_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(hf_dir).eval()


def _spy_forwards(eng: BuiltinEngine, before) -> callable:
    """Call `before(rows)` ahead of every model forward (prefill or decode, on either decode path),
    `rows` being the forward's batch size; returns the function that removes the spy."""
    if eng._decoder is None:
        forward = eng.model.forward

        def spy(*args, **kwargs):
            before(kwargs["input_ids"].shape[0])
            return forward(*args, **kwargs)

        eng.model.forward = spy
        return lambda: setattr(eng.model, "forward", forward)
    dec = eng._decoder
    prefill, decode = dec.prefill_into, dec.decode

    def spy_prefill(ids, *args):
        before(ids.shape[0])
        return prefill(ids, *args)

    def spy_decode(tokens, *args):
        before(tokens.shape[0])
        return decode(tokens, *args)

    dec.prefill_into, dec.decode = spy_prefill, spy_decode
    return lambda: (delattr(dec, "prefill_into"), delattr(dec, "decode"))


def _ids(engine: BuiltinEngine, text: str) -> list[int]:
    return engine.tokenizer(text)["input_ids"]


def _req(engine: BuiltinEngine, text: str, rid: str | None = None, **sp) -> GenerateRequest:
    return GenerateRequest(_ids(engine, text), SamplingParams(**sp), return_logprob=True, rid=rid)


def test_greedy_matches_hf_generate_token_for_token(engine, hf_model):
    prompts = PROMPTS[::7] + PROMPTS[-3:]  # mixed lengths: left padding in both
    ours = engine.generate([_req(engine, p, temperature=0, max_new_tokens=8) for p in prompts])
    enc = engine.tokenizer(prompts, return_tensors="pt", padding=True)
    with torch.no_grad():
        ref = hf_model.generate(
            **enc, do_sample=False, max_new_tokens=8, eos_token_id=EOS, pad_token_id=engine.pad_token_id
        )[:, enc["input_ids"].shape[1] :].tolist()
    n_eos = 0
    for resp, row in zip(ours, ref):
        expected = row[: row.index(EOS) + 1] if EOS in row else row
        assert resp.output_ids == expected
        assert resp.text == engine.tokenizer.decode(expected, skip_special_tokens=True)
        n_eos += EOS in expected
    assert 0 < n_eos < len(prompts)  # both the eos and the length path were compared


@pytest.mark.parametrize(
    "sp, original",
    [
        (dict(temperature=1.0), False),
        (dict(temperature=0.7, top_k=5, top_p=0.9), False),
        (dict(temperature=0.7, top_k=5), True),
        (dict(temperature=0.0), False),
    ],
)
def test_logprobs_equal_a_full_forward_pass(hf_dir, path, hf_model, sp, original):
    eng = BuiltinEngine(hf_dir, decode_path=path, seed=3, return_original_logprob=original)
    prompts = PROMPTS[:24:3] + PROMPTS[-3:]
    outs = eng.generate([_req(eng, p, max_new_tokens=8, **sp) for p in prompts])
    t = sp["temperature"] if sp["temperature"] > 0 and not original else 1.0
    for prompt, resp in zip(prompts, outs):
        ids = _ids(eng, prompt) + resp.output_ids
        with torch.no_grad():
            logits = hf_model(torch.tensor([ids])).logits[0].float()
        logp = torch.log_softmax(logits / t, dim=-1)
        n = len(_ids(eng, prompt))
        expected = [logp[n - 1 + k, tok].item() for k, tok in enumerate(resp.output_ids)]
        assert len(resp.output_token_logprobs) == len(resp.output_ids) > 0
        assert resp.output_token_logprobs == pytest.approx(expected, abs=1e-5)


def test_batched_equals_one_by_one_greedy(hf_dir, path):
    eng = BuiltinEngine(hf_dir, decode_path=path, max_batch_size=16)  # 103 prompts: 7 batches, padding and row dropping
    reqs = [_req(eng, p, temperature=0, max_new_tokens=10) for p in PROMPTS]
    batched = eng.generate(reqs)
    single = [eng.generate([r])[0] for r in reqs[::5]]
    for b, s in zip(batched[::5], single):
        assert b.output_ids == s.output_ids
        assert b.finish_reason == s.finish_reason
        assert b.output_token_logprobs == pytest.approx(s.output_token_logprobs, abs=1e-5)


def test_repeated_prompts_share_a_prefill_and_match_solo_runs(hf_dir, path):
    eng = BuiltinEngine(hf_dir, decode_path=path, seed=0)
    prompts = ["3+4=", "12+3=", "9="]
    greedy = eng.generate([_req(eng, p, temperature=0, max_new_tokens=8) for p in prompts for _ in range(4)])
    for k, p in enumerate(prompts):
        [solo] = eng.generate([_req(eng, p, temperature=0, max_new_tokens=8)])
        for r in greedy[4 * k : 4 * k + 4]:
            assert r.output_ids == solo.output_ids
            assert r.output_token_logprobs == pytest.approx(solo.output_token_logprobs, abs=1e-5)
    # Sampled copies of one prompt (seeds 0..7) are independent draws, each equal to its solo run.
    copies = eng.generate([_req(eng, "3+4=", max_new_tokens=8, seed=s) for s in range(8)])
    assert len({tuple(r.output_ids) for r in copies}) > 1
    for s in (0, 5):
        [solo] = eng.generate([_req(eng, "3+4=", max_new_tokens=8, seed=s)])
        assert copies[s].output_ids == solo.output_ids


def test_mixed_limits_and_stops_in_one_batch_match_solo_runs(hf_dir, path):
    # Different max_new_tokens, stop strings and stop ids per row: rows finish at different steps,
    # the batch is compacted several times, and each row must still equal its solo run.
    eng = BuiltinEngine(hf_dir, decode_path=path, seed=0)
    reqs = []
    for k, p in enumerate(PROMPTS[:40]):
        sp = dict(temperature=0, max_new_tokens=1 + k % 9)
        if k % 3 == 0:
            sp["stop"] = ["7", "=="]
        if k % 4 == 1:
            sp["stop_token_ids"] = [9]
        if k % 5 == 2:
            sp.update(temperature=1.0, seed=k)
        reqs.append(GenerateRequest(_ids(eng, p), SamplingParams(**sp), return_logprob=True))
    batched = eng.generate(reqs)
    for req, b in zip(reqs, batched):
        [s] = eng.generate([req])
        assert (b.output_ids, b.finish_reason, b.text) == (s.output_ids, s.finish_reason, s.text)
        assert len(b.output_ids) <= req.sampling_params.max_new_tokens
    reasons = {b.finish_type for b in batched}
    matched = {b.matched for b in batched if b.finish_type == "stop"}
    assert reasons == {"stop", "length"}
    assert EOS in matched and any(isinstance(m, str) for m in matched)  # ids and strings both hit


def test_finish_reasons_stop_token_stop_string_length_and_eos(engine):
    free = engine.generate([_req(engine, p, temperature=0, max_new_tokens=8) for p in PROMPTS[:20]])
    # eos (the default stop id): kept in output_ids, dropped from text by skip_special_tokens.
    with_eos = next(r for r in free if r.finish_type == "stop")
    assert with_eos.output_ids[-1] == EOS and with_eos.finish_reason == {"type": "stop", "matched": EOS}
    assert engine.tokenizer.eos_token not in with_eos.text
    # A long free answer: stop at its 3rd token via stop_token_ids, then via a stop string.
    i, long = next((i, r) for i, r in enumerate(free) if r.finish_type == "length")
    assert long.finish_reason == {"type": "length", "length": 8} and len(long.output_ids) == 8
    tok = long.output_ids[2]
    first = long.output_ids.index(tok)
    [r] = engine.generate([_req(engine, PROMPTS[i], temperature=0, max_new_tokens=8, stop_token_ids=[tok])])
    assert r.output_ids == long.output_ids[: first + 1]
    assert r.finish_reason == {"type": "stop", "matched": tok}
    stop = engine.tokenizer.decode(long.output_ids[2:4])
    [r] = engine.generate([_req(engine, PROMPTS[i], temperature=0, max_new_tokens=8, stop=[stop, "@@"])])
    assert r.finish_reason == {"type": "stop", "matched": stop}
    assert r.text.endswith(stop) and stop not in r.text[:-1]
    assert long.text.startswith(r.text)
    [r] = engine.generate([_req(engine, PROMPTS[i], temperature=0, max_new_tokens=3)])
    assert r.output_ids == long.output_ids[:3] and r.finish_reason["type"] == "length"
    [r] = engine.generate([_req(engine, PROMPTS[i], max_new_tokens=0)])
    assert r.output_ids == [] and r.finish_type == "length" and r.output_token_logprobs == []


def test_same_seed_same_sample_whatever_the_batch(engine):
    def seeded(seed: int) -> GenerateRequest:
        return _req(engine, "3+4=", temperature=1.0, max_new_tokens=8, seed=seed)

    alone = engine.generate([seeded(123)])[0]
    others = [_req(engine, p, temperature=1.0, max_new_tokens=8) for p in PROMPTS[:9]]
    in_batch = engine.generate(others[:4] + [seeded(123)] + others[4:])[4]
    assert in_batch.output_ids == alone.output_ids
    assert in_batch.output_token_logprobs == pytest.approx(alone.output_token_logprobs, abs=1e-5)
    samples = {tuple(engine.generate([seeded(s)])[0].output_ids) for s in range(8)}
    assert len(samples) > 1  # the seed matters


def test_engine_seed_makes_unseeded_runs_reproducible(hf_dir, path):
    def run(seed: int) -> list[list[int]]:
        eng = BuiltinEngine(hf_dir, decode_path=path, seed=seed)
        reqs = [GenerateRequest(_ids(eng, p), SamplingParams(max_new_tokens=6)) for p in PROMPTS[:16]]
        return [r.output_ids for r in eng.generate(reqs)]

    assert run(5) == run(5)
    assert run(5) != run(6)


def test_sampler_matches_the_distribution():
    # 20k rows with p = [0.5, 0.3, 0.15, 0.05]: frequencies within 4 standard errors.
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    n = 20_000
    logits = probs.log().repeat(n, 1)
    keys = torch.arange(n, dtype=torch.int64)
    params = BatchParams(torch.ones(n), torch.full((n,), -1), torch.ones(n), keys)
    for step in (0, 1):
        tokens, logp = sample_next(logits, params, step)
        freq = torch.bincount(tokens, minlength=4).float() / n
        assert torch.allclose(freq, probs, atol=4 * (0.25 / n) ** 0.5)
        assert torch.allclose(logp, probs.log()[tokens])
    # Successive steps of one row are independent draws, not a repeat.
    assert not torch.equal(sample_next(logits, params, 0)[0], sample_next(logits, params, 1)[0])
    # top-k 2 then top-p 0.5 of the rest (0.5/0.8 = 0.625 >= 0.5): only token 0 survives.
    params = BatchParams(torch.ones(n), torch.full((n,), 2), torch.full((n,), 0.5), keys)
    assert sample_next(logits, params, 0)[0].eq(0).all()


@pytest.mark.parametrize("vocab", [19, 1000, 8192])  # one level; two levels with a padded last block; 64 full blocks
def test_sampler_is_the_inverse_cdf_of_the_tempered_distribution(vocab):
    # The sampler must pick, for uniform u, the first token whose cumulative probability exceeds u
    # (computed here the plain way: softmax, float64 cumsum over the whole vocabulary), and return
    # log_softmax(logits / T) of it. Rows mix temperatures 1, 0.7 and greedy.
    n = 3000
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(n, vocab, generator=g) * 3
    temps = torch.tensor([1.0, 0.7, 0.0]).repeat(n // 3)
    keys = torch.arange(n, dtype=torch.int64)
    params = BatchParams(temps, torch.full((n,), -1), torch.ones(n), keys)
    tokens, logp = sample_next(logits, params, 4)
    t = torch.where(temps == 0, torch.ones_like(temps), temps)
    ref_logp = torch.log_softmax(logits / t[:, None], dim=-1)
    cdf = ref_logp.double().exp().cumsum(-1)
    u = uniform_noise(keys, torch.full((n,), 4))
    expected = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).squeeze(1).clamp(max=vocab - 1)
    expected = torch.where(temps == 0, logits.argmax(-1), expected)
    assert (tokens != expected).sum() <= 1  # a u within rounding of a cumulative boundary may land either side
    assert torch.allclose(logp, ref_logp.gather(1, tokens[:, None]).squeeze(1), atol=1e-5)
    if vocab > 19:  # draws from many blocks, not only the first or the last
        assert len(set((tokens[temps > 0] // 128).tolist())) > vocab // 128 // 2


def _splitmix64_reference(state: int, i: int) -> int:
    """The i-th output (1-based) of SplitMix64 from `state`, in plain Python integers."""
    m = 2**64
    z = (state + i * 0x9E3779B97F4A7C15) % m
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) % m
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) % m
    return z ^ (z >> 31)


def test_noise_is_splitmix64_and_uniform():
    # 1234567 through SplitMix64 is a published test vector (first output 6457827717110365317).
    assert _splitmix64_reference(1234567, 1) == 6457827717110365317
    states = [0, 1, 1234567, 2**63 + 5, 2**64 - 1]
    signed = torch.tensor([x - 2**64 if x >= 2**63 else x for x in states], dtype=torch.int64)
    got = [x % 2**64 for x in mix64(signed + _GOLDEN).tolist()]
    assert got == [_splitmix64_reference(x, 1) for x in states]  # int64 wraparound is exact
    # Row r at step s: the first output of SplitMix64 from state mix64(key + s * golden), top 53 bits.
    keys, steps = torch.tensor([3, -7, 2**62]), torch.tensor([0, 5, 9])
    for k, st, u in zip(keys.tolist(), steps.tolist(), uniform_noise(keys, steps).tolist()):
        state = _splitmix64_reference((k + st * 0x9E3779B97F4A7C15) % 2**64 - 0x9E3779B97F4A7C15, 1)
        assert u == (_splitmix64_reference(state, 1) >> 11) * 2.0**-53
    u = uniform_noise(torch.arange(100_000, dtype=torch.int64), torch.full((100_000,), 3))
    assert bool((u >= 0).all()) and bool((u < 1).all())
    assert abs(u.mean().item() - 0.5) < 0.005 and abs(u.var().item() - 1 / 12) < 0.002
    assert not torch.equal(u, uniform_noise(torch.arange(100_000, dtype=torch.int64), torch.full((100_000,), 4)))


def test_top_k_and_top_p_by_hand():
    p = torch.tensor([[0.15, 0.5, 0.05, 0.3]] * 4)
    expected = [
        [0.0, 0.5, 0.0, 0.3],
        [0.0, 0.5, 0.0, 0.0],
        [0.15, 0.5, 0.05, 0.3],
        [0.15, 0.5, 0.05, 0.3],
    ]
    assert torch.equal(_apply_top_k(p, torch.tensor([2, 1, -1, 4])), torch.tensor(expected))
    # Smallest set reaching p: 0.5 alone reaches 0.5; 0.5+0.3 reach 0.7; 0.5+0.3+0.15 reach 0.9.
    out = _apply_top_p(p, torch.tensor([0.5, 0.7, 0.9, 1.0]))
    expected = [
        [0.0, 0.5, 0.0, 0.0],
        [0.0, 0.5, 0.0, 0.3],
        [0.15, 0.5, 0.0, 0.3],
        [0.15, 0.5, 0.05, 0.3],
    ]
    assert torch.equal(out, torch.tensor(expected))


def test_update_weights_in_buckets_then_parameters_equal_bit_for_bit(hf_dir, path, hf_model):
    from transformers import AutoModelForCausalLM

    eng = BuiltinEngine(hf_dir, decode_path=path)
    new = AutoModelForCausalLM.from_pretrained(hf_dir)
    _sharpen(new, seed=2)
    sent = list(new.state_dict().items())  # includes the tied lm_head.weight under its own name
    before = eng.generate([_req(eng, p, temperature=0, max_new_tokens=6) for p in PROMPTS[:10]])
    buckets = list(iter_weight_buckets(sent, bucket_bytes=20_000))
    assert len(buckets) > 5
    eng.pause_generation()
    eng.begin_weight_update()
    for bucket in buckets:
        eng.update_weights_from_tensors(bucket)
    eng.end_weight_update(7)
    eng.continue_generation()
    engine_params = dict(eng.named_parameters())
    for name, tensor in new.named_parameters():
        assert torch.equal(engine_params[name], tensor), name
    assert eng.get_weights_checksum() == weights_checksum(new.named_parameters())
    assert eng.get_weights_checksum() != weights_checksum(hf_model.named_parameters())
    after = eng.generate([_req(eng, p, temperature=0, max_new_tokens=6) for p in PROMPTS[:10]])
    assert all(r.weight_version == 7 for r in after) and before[0].weight_version == 0
    assert [r.output_ids for r in after] != [r.output_ids for r in before]
    assert eng.health()["weight_version"] == 7
    # What the engine computes now is the new model's forward (no stale copy of any weight anywhere).
    new.eval()
    for prompt, resp in zip(PROMPTS[:10], after):
        ids = _ids(eng, prompt)
        with torch.no_grad():
            logp = torch.log_softmax(new(torch.tensor([ids + resp.output_ids])).logits[0].float(), dim=-1)
        expected = [logp[len(ids) - 1 + k, tok].item() for k, tok in enumerate(resp.output_ids)]
        assert resp.output_token_logprobs == pytest.approx(expected, abs=1e-5)
        assert resp.output_ids == logp[len(ids) - 1 : -1].argmax(-1).tolist()  # greedy under the new weights


def test_weight_update_rejects_misuse(engine):
    name, param = next(iter(engine.named_parameters()))
    with pytest.raises(RuntimeError, match="begin_weight_update"):
        engine.update_weights_from_tensors([(name, param.clone())])
    engine.begin_weight_update()
    try:
        with pytest.raises(KeyError, match="not a parameter"):
            engine.update_weights_from_tensors([("model.nope.weight", param.clone())])
        with pytest.raises(ValueError, match="shape"):
            engine.update_weights_from_tensors([(name, param.clone()[:1])])
    finally:
        engine.end_weight_update(engine.weight_version)


def test_pause_aborts_in_flight_requests_and_blocks_new_ones(hf_dir, path):
    eng = BuiltinEngine(hf_dir, decode_path=path, wait_timeout_s=0.2)
    calls = {"n": 0}

    def pause_at_third(rows):
        calls["n"] += 1
        if calls["n"] == 3:  # prefill + 2 decode steps (2 tokens sampled), then a pause arrives
            eng.pause_generation()

    undo = _spy_forwards(eng, pause_at_third)
    out = eng.generate([_req(eng, p, temperature=0, max_new_tokens=50, stop_token_ids=[]) for p in ["1+1=", "2+2="]])
    undo()
    for r in out:
        if r.finish_type != "stop":  # a row may legitimately hit eos before the pause
            assert r.finish_reason == {"type": "abort"} and len(r.output_ids) == 2
    assert any(r.finish_type == "abort" for r in out)
    with pytest.raises(TimeoutError, match="continue_generation"):
        eng.generate([_req(eng, "1+1=", max_new_tokens=2)])
    # A generate() waiting on the pause proceeds as soon as generation continues.
    eng.wait_timeout_s = 30.0
    result: list = []
    waiter = threading.Thread(target=lambda: result.extend(eng.generate([_req(eng, "1+1=", max_new_tokens=2)])))
    waiter.start()
    eng.continue_generation()
    waiter.join(timeout=30)
    assert len(result) == 1 and result[0].finish_type in ("stop", "length")
    assert eng.health()["paused"] is False


def test_an_abort_the_scheduler_reaches_late_spares_requests_submitted_after_it(hf_dir, path):
    """A weight update's pause aborts what was in flight, never the next rollout's requests. On a busy
    machine the scheduler thread may run only after the pause, the update and continue_generation()
    have all returned and new requests are queued (here: it cannot take the lock until then); the
    pause used to stay pending and abort all of them, an empty rollout and a wasted step. A rid
    abort is bounded the same way."""
    eng = BuiltinEngine(hf_dir, decode_path=path)
    eng.generate([_req(eng, "1+1=", max_new_tokens=1)])  # the scheduler thread exists and is idle
    with eng._cond:
        eng.pause_generation()
        eng.begin_weight_update()
        eng.end_weight_update(1)
        eng.continue_generation()
        eng.abort_request("late-")
        futures = [eng.submit(GenerateRequest(_ids(eng, p), SamplingParams(temperature=0, max_new_tokens=3), rid=f"late-{i}"))
                   for i, p in enumerate(["1+1=", "2+3=", "4+4="])]  # fmt: skip
    out = [f.result(timeout=60) for f in futures]
    assert all(r.finish_type in ("stop", "length") for r in out), [r.finish_type for r in out]
    assert all(r.weight_version == 1 and r.output_ids for r in out)


def test_a_directory_without_a_model_is_a_user_error(tmp_path):
    from miles.errors import UserError

    with pytest.raises(UserError, match="no config.json") as err:
        BuiltinEngine(tmp_path)
    assert err.value.option == "--hf-checkpoint"


def test_continuous_batching_a_waiting_request_takes_a_finished_rows_slot(hf_dir, path):
    # Two slots; a 40-token request, a 2-token one and a third that waits. The third must be decoded
    # alongside the long one (it takes the short one's slot), not after it, and every row must
    # equal its solo run (greedy and seeded sampling alike) although it joined a batch mid-flight.
    eng = BuiltinEngine(hf_dir, decode_path=path, max_batch_size=2)
    reqs = [
        _req(eng, "1+2=", temperature=0, max_new_tokens=40, stop_token_ids=[], rid="long"),
        _req(eng, "33+4=", temperature=0, max_new_tokens=2, rid="short"),
        _req(eng, "5+6=", temperature=1.0, max_new_tokens=6, seed=11, stop_token_ids=[], rid="late"),
    ]
    for r in reqs:
        r.sampling_params.stop_token_ids = []  # no eos either: lengths are exactly max_new_tokens
    eng.eos_token_ids = frozenset()
    solo = [eng.generate([r])[0] for r in reqs]
    sizes: list[int] = []
    undo = _spy_forwards(eng, sizes.append)
    together = eng.generate(reqs)
    undo()
    for a, b in zip(together, solo):
        assert a.output_ids == b.output_ids and a.finish_type == "length"
        assert a.output_token_logprobs == pytest.approx(b.output_token_logprobs, abs=1e-5)
    # One prefill of 2 prompts, 2 decode steps of 2 rows, a prefill of the late one, then 2-row steps
    # until the late row (6 tokens) is done, then the long row alone: 40 tokens need ~41 forwards.
    assert sizes[0] == 2 and sizes[3] == 1 and sizes[4] == 2
    assert len(sizes) <= 43, sizes  # without continuous batching: 40 + 6 + prefills


def test_abort_request_by_rid_prefix_returns_partial_output(hf_dir, path):
    eng = BuiltinEngine(hf_dir, decode_path=path, max_batch_size=8)
    eng.eos_token_ids = frozenset()
    futures = [eng.submit(_req(eng, p, temperature=0, max_new_tokens=200, rid=f"g1-{i}")) for i, p in enumerate(PROMPTS[:3])]
    keep = eng.submit(_req(eng, "4+4=", temperature=0, max_new_tokens=5, rid="g2-0"))
    eng.abort_request("g1-")
    aborted = [f.result(timeout=60) for f in futures]
    assert all(r.finish_type == "abort" and len(r.output_ids) < 200 for r in aborted)
    assert keep.result(timeout=60).finish_type == "length"


def test_a_failing_forward_fails_its_requests_and_the_next_batch_starts_clean(hf_dir, path):
    eng = BuiltinEngine(hf_dir, decode_path=path)
    reqs = [_req(eng, p, temperature=0, max_new_tokens=6) for p in PROMPTS[:5]]
    expected = [r.output_ids for r in eng.generate(reqs)]
    calls = {"n": 0}

    def fail_on_third(rows):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("forward failed on purpose")

    undo = _spy_forwards(eng, fail_on_third)
    with pytest.raises(RuntimeError, match="on purpose"):
        eng.generate(reqs)
    undo()
    # Nothing of the failed batch leaks into the next one: same outputs, and its rows are not decoded.
    sizes: list[int] = []
    undo = _spy_forwards(eng, sizes.append)
    assert [r.output_ids for r in eng.generate(reqs)] == expected
    undo()
    assert max(sizes) <= len(reqs), sizes
