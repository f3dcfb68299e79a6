"""Packed forward: log-probs against a hand loop over prefixes, in both layouts, at a temperature;
pack_samples and the packed-stream index helpers."""

from __future__ import annotations

import math

import pytest
import torch
from backend_fixtures import make_train_data

from miles.backends.packing import position_ids, response_positions
from miles.train.packing import pack_samples
from miles.backends.torch.forward import ResponseLogits, choose_layout, response_log_probs


@pytest.fixture(scope="module")
def model(tiny_hf_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_hf_dir, dtype=torch.float32, attn_implementation="eager").eval()


def _hand_log_probs(model, tokens: list[int], response_length: int, temperature: float = 1.0) -> torch.Tensor:
    """Token t's log-prob: run the model on tokens[:t] alone, read the last position's distribution."""
    out = []
    for t in range(len(tokens) - response_length, len(tokens)):
        logits = model(input_ids=torch.tensor([tokens[:t]])).logits[0, -1]
        out.append(torch.log_softmax(logits.double() / temperature, dim=-1)[tokens[t]])
    return torch.stack(out).float() if out else torch.zeros(0)


@pytest.mark.parametrize("layout", ["packed", "padded"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_both_layouts_match_a_hand_loop_over_prefixes(model, layout, temperature):
    data = make_train_data(5, seed=3)
    batch = pack_samples(data, range(5), "cpu")
    with torch.no_grad():
        lp, _ = response_log_probs(ResponseLogits(model), batch, temperature=temperature, layout=layout)
    assert lp.shape == (sum(data["response_lengths"]),)
    expected = torch.cat([_hand_log_probs(model, t, r, temperature) for t, r in zip(data["tokens"], data["response_lengths"])])
    torch.testing.assert_close(lp, expected, rtol=0, atol=1e-5)


def test_temperature_zero_means_unscaled_log_probs(model):
    batch = pack_samples(make_train_data(2, seed=1), [0, 1], "cpu")
    with torch.no_grad():
        greedy, _ = response_log_probs(ResponseLogits(model), batch, temperature=0.0)
        plain, _ = response_log_probs(ResponseLogits(model), batch, temperature=1.0)
    assert torch.equal(greedy, plain)


def test_an_off_by_one_shift_would_be_caught(model):
    # Guard for the test above: the log-probs of the *next* token differ by far more than its tolerance.
    data = make_train_data(1, seed=4)
    tokens, r = data["tokens"][0], data["response_lengths"][0]
    with torch.no_grad():
        lp, _ = response_log_probs(ResponseLogits(model), pack_samples(data, [0], "cpu"), temperature=1.0)
        shifted = _hand_log_probs(model, tokens[1:] + [5], r)
    assert (lp - shifted).abs().max() > 1e-3


def test_entropy_and_empty_response(model):
    data = {"tokens": [[4, 5, 6, 7], [8, 9, 10]], "response_lengths": [2, 0], "loss_masks": [[1, 1], []]}
    with torch.no_grad():
        lp, ent = response_log_probs(ResponseLogits(model), pack_samples(data, [0, 1], "cpu"), temperature=1.0, with_entropy=True)
    assert lp.shape == (2,) and ent.shape == (2,)
    # the entropy of a distribution over 32 tokens lies in (0, log 32]
    assert ((ent > 0) & (ent <= math.log(32) + 1e-5)).all()


def test_pack_samples_layout_and_helpers():
    data = {
        "tokens": [[5, 6, 7, 8], [9, 10, 11], [12, 13]],
        "response_lengths": [2, 1, 1],
        "loss_masks": [[1, 0], [1], [1]],
        "rollout_log_probs": [[-0.5, -0.25], [-1.0], [-2.0]],
    }
    b = pack_samples(data, [2, 0], "cpu")  # order follows the indices
    assert b.tokens.tolist() == [12, 13, 5, 6, 7, 8]
    assert b.cu_seqlens.tolist() == [0, 2, 6]
    assert b.response_lengths.tolist() == [1, 2]
    assert b.loss_mask.tolist() == [1.0, 1.0, 0.0] and b.loss_mask.dtype == torch.float32
    assert b.rollout_log_probs.tolist() == [-2.0, -0.5, -0.25]
    assert b.advantages is None and b.num_samples == 2
    assert b.response_cu_seqlens.tolist() == [0, 1, 3]
    assert b.sample_index_of_token.tolist() == [0, 1, 1]
    assert position_ids(b).tolist() == [0, 1, 0, 1, 2, 3]
    assert response_positions(b).tolist() == [1, 4, 5]  # tokens 13, 7, 8


@pytest.mark.parametrize(
    "data, match",
    [
        ({"tokens": [[4, 5]], "response_lengths": [2], "loss_masks": [[1, 1]]}, "prompt token"),
        ({"tokens": [[4, 5, 6]], "response_lengths": [2], "loss_masks": [[1]]}, "loss mask"),
        ({"tokens": [[4, 5, 6]], "response_lengths": [1], "loss_masks": [[1]], "rollout_log_probs": [[]]}, "rollout log-probs"),
    ],
)
def test_pack_samples_rejects_inconsistent_samples(data, match):
    with pytest.raises(ValueError, match=match):
        pack_samples(data, [0], "cpu")


def test_choose_layout_by_cost():
    assert choose_layout([128] * 16, 256) == "padded"  # equal lengths: padding wastes nothing, packing costs T^2
    assert choose_layout([2000] + [10] * 15, 64) == "packed"  # one long sample: padding 16 rows to 2000 costs more


def test_fast_entropy_matches_the_careful_formula_and_survives_masked_logits():
    from miles.algo.entropy import entropy_from_logits
    from miles.backends.torch.forward import log_probs_from_logits

    logits = torch.randn(5, 11, generator=torch.Generator().manual_seed(0)) * 3
    logits[2, 4] = float("-inf")  # a masked vocabulary entry: 0 * -inf would be NaN in the fast formula
    targets = torch.tensor([0, 1, 2, 3, 5])
    lp, ent = log_probs_from_logits(logits, targets, temperature=1.0, with_entropy=True, entropy_grad=False)
    torch.testing.assert_close(ent, entropy_from_logits(logits), rtol=0, atol=1e-5)
    torch.testing.assert_close(lp, torch.log_softmax(logits, -1)[torch.arange(5), targets], rtol=0, atol=1e-6)
