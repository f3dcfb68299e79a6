"""The engine interface's pure parts: weight buckets, the weights checksum, SGLang-shaped JSON."""

from __future__ import annotations

import pytest
import torch

from miles.rollout.engine.base import (
    GenerateRequest,
    GenerateResponse,
    SamplingParams,
    iter_weight_buckets,
    weights_checksum,
)

torch.set_num_threads(1)


def _named(*numels: int, dtype=torch.float32) -> list[tuple[str, torch.Tensor]]:
    return [(f"w{i}", torch.zeros(n, dtype=dtype)) for i, n in enumerate(numels)]


def _names(buckets) -> list[list[str]]:
    return [[name for name, _ in b] for b in buckets]


def test_buckets_by_hand():
    # float32: 4 bytes per element. Sizes 16, 16, 16, 40, 8 bytes.
    named = _named(4, 4, 4, 10, 2)
    assert _names(iter_weight_buckets(named, 32)) == [["w0", "w1"], ["w2"], ["w3"], ["w4"]]
    assert _names(iter_weight_buckets(named, 48)) == [["w0", "w1", "w2"], ["w3", "w4"]]
    assert _names(iter_weight_buckets(named, 96)) == [["w0", "w1", "w2", "w3", "w4"]]  # exactly full
    assert _names(iter_weight_buckets(named, 95)) == [["w0", "w1", "w2", "w3"], ["w4"]]
    # A tensor larger than a bucket goes alone, without emptying what came before it into it.
    assert _names(iter_weight_buckets(named, 20)) == [["w0"], ["w1"], ["w2"], ["w3"], ["w4"]]
    # bf16 is 2 bytes per element: w3 (20 bytes) no longer needs a bucket of its own at 28.
    assert _names(iter_weight_buckets(_named(4, 4, 4, 10, 2, dtype=torch.bfloat16), 28)) == [
        ["w0", "w1", "w2"],
        ["w3", "w4"],
    ]


def test_buckets_keep_every_tensor_once_in_order_and_within_the_limit():
    g = torch.Generator().manual_seed(0)
    numels = torch.randint(1, 300, (200,), generator=g).tolist()
    named = _named(*numels)
    limit = 4 * 500
    buckets = list(iter_weight_buckets(named, limit))
    assert [t for b in buckets for t in b] == named  # same objects, same order
    for b in buckets:
        assert sum(t.numel() * 4 for _, t in b) <= limit
    # Greedy: the next bucket's first tensor would not have fitted into the previous bucket.
    for prev, nxt in zip(buckets, buckets[1:]):
        assert sum(t.numel() * 4 for _, t in prev) + nxt[0][1].numel() * 4 > limit


def test_buckets_are_lazy_and_reject_a_nonpositive_size():
    pulled: list[str] = []

    def source():
        for name, t in _named(4, 4, 4, 4):
            pulled.append(name)
            yield name, t

    first = next(iter_weight_buckets(source(), 32))
    assert _names([first]) == [["w0", "w1"]] and pulled == ["w0", "w1", "w2"]
    with pytest.raises(ValueError, match="update-weight-buffer-size"):
        list(iter_weight_buckets(_named(1), 0))


def test_checksum_sees_one_bit_and_ignores_order():
    a = [("b", torch.arange(6, dtype=torch.float32).reshape(2, 3)), ("a", torch.ones(3))]
    base = weights_checksum(a)
    assert weights_checksum(list(reversed(a))) == base
    flipped = a[0][1].clone()
    flipped.view(torch.int32)[1, 2] ^= 1  # lowest mantissa bit of one element
    assert weights_checksum([("b", flipped), a[1]]) != base
    assert weights_checksum([("b", a[0][1].reshape(3, 2)), a[1]]) != base  # shape counts
    assert weights_checksum([("b", a[0][1].double()), a[1]]) != base  # dtype counts
    assert weights_checksum([("c", a[0][1]), a[1]]) != base  # names count
    assert weights_checksum(a + [("a", torch.ones(3))]) == base  # a tied name listed twice


def test_sampling_params_follow_sglang_names():
    sp = SamplingParams.from_dict({"temperature": 0.5, "top_k": 3, "stop": "\n", "sampling_seed": 9})
    assert sp.seed == 9 and sp.stop == ["\n"] and sp.top_p == 1.0 and sp.top_k == 3
    assert sp.to_dict()["sampling_seed"] == 9 and "seed" not in sp.to_dict()
    assert SamplingParams.from_dict(sp.to_dict()) == sp
    # Other SGLang keys pass through untouched (an SGLang server honours them) ...
    passed = SamplingParams.from_dict({"frequency_penalty": 1.0, "no_stop_trim": True, "min_p": None})
    assert passed.extra == {"frequency_penalty": 1.0, "no_stop_trim": True}  # null = SGLang's default
    assert passed.to_dict()["frequency_penalty"] == 1.0 and SamplingParams.from_dict(passed.to_dict()) == passed
    # ... and the built-in engine refuses, by name, the ones it cannot honour.
    from miles.rollout.engine.builtin import reject_unsupported_sampling

    with pytest.raises(ValueError, match=r"frequency_penalty=1\.0.*--rollout-backend sglang"):
        reject_unsupported_sampling(passed)
    with pytest.raises(ValueError, match="not an SGLang sampling key"):
        reject_unsupported_sampling(SamplingParams.from_dict({"temprature": 1.0}))
    reject_unsupported_sampling(SamplingParams.from_dict({"frequency_penalty": 0.0, "no_stop_trim": True}))
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)


def test_sampling_params_from_the_rollout_config():
    from miles.config.rollout import RolloutConfig

    cfg = RolloutConfig(
        rollout_temperature=0.8, rollout_top_p=0.9, rollout_top_k=5, rollout_max_response_len=6,
        rollout_stop=["\n"], rollout_stop_token_ids=[7], rollout_skip_special_tokens=True,
    )
    assert SamplingParams.from_rollout_config(cfg, seed=3) == SamplingParams(
        temperature=0.8, top_p=0.9, top_k=5, max_new_tokens=6, stop=["\n"], stop_token_ids=[7],
        skip_special_tokens=True, seed=3,
    )
    # Upstream's default keeps special tokens in the text; SGLang's request default drops them.
    assert SamplingParams.from_rollout_config(RolloutConfig()).skip_special_tokens is False


def test_request_json_round_trip():
    req = GenerateRequest([1, 2, 3], {"max_new_tokens": 4, "temperature": 0}, return_logprob=True, rid="r1")
    assert isinstance(req.sampling_params, SamplingParams)
    j = req.to_json()
    assert j["input_ids"] == [1, 2, 3] and j["sampling_params"]["max_new_tokens"] == 4
    assert GenerateRequest.from_json(j) == req
    with pytest.raises(ValueError, match="at least one input token"):
        GenerateRequest([])


def test_response_reads_a_real_sglang_answer():
    answer = {
        "text": "8",
        "meta_info": {
            "id": "abc",
            "finish_reason": {"type": "stop", "matched": 2},
            "prompt_tokens": 4,
            "completion_tokens": 2,
            "weight_version": "3",
            "output_token_logprobs": [[-0.25, 12, None], [-0.5, 2, None]],
        },
    }
    r = GenerateResponse.from_sglang_json(answer)
    assert r.output_ids == [12, 2] and r.output_token_logprobs == [-0.25, -0.5]
    assert r.weight_version == 3 and r.matched == 2 and r.rid == "abc"
    assert r.meta_info == {
        "id": "abc",
        "finish_reason": {"type": "stop", "matched": 2},
        "prompt_tokens": 4,
        "completion_tokens": 2,
        "weight_version": 3,
    }
    length = GenerateResponse([5, 6, 7], "567", "length", prompt_tokens=2)
    assert length.finish_reason == {"type": "length", "length": 3}
    assert GenerateResponse.from_sglang_json(length.to_json()) == length
