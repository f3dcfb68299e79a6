"""Response log-probs: alignment against a hand loop over prefixes, padding invariance, edge cases."""

from __future__ import annotations

import pytest
import torch
from backend_fixtures import make_train_data

from miles.backends.torch.forward import pad_right, response_log_probs


@pytest.fixture(scope="module")
def model(tiny_hf_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_hf_dir, dtype=torch.float32, attn_implementation="eager").eval()


def _hand_log_probs(model, tokens: list[int], response_length: int) -> torch.Tensor:
    """Token t's log-prob: run the model on tokens[:t] alone, read the last position's distribution."""
    out = []
    for t in range(len(tokens) - response_length, len(tokens)):
        logits = model(input_ids=torch.tensor([tokens[:t]])).logits[0, -1]
        out.append(torch.log_softmax(logits.double(), dim=-1)[tokens[t]])
    return torch.stack(out).float()


def test_padded_batch_matches_a_hand_loop_over_prefixes(model):
    data = make_train_data(5, seed=3)
    with torch.no_grad():
        log_probs, _ = response_log_probs(model, data["tokens"], data["response_lengths"])
        for lp, tokens, r in zip(log_probs, data["tokens"], data["response_lengths"]):
            assert lp.shape == (r,)
            torch.testing.assert_close(lp, _hand_log_probs(model, tokens, r), rtol=0, atol=1e-5)


def test_an_off_by_one_shift_would_be_caught(model):
    # Guard for the test above: the log-probs of the *next* token differ by far more than its tolerance.
    data = make_train_data(1, seed=4)
    tokens, r = data["tokens"][0], data["response_lengths"][0]
    with torch.no_grad():
        (lp,), _ = response_log_probs(model, [tokens], [r])
        shifted = _hand_log_probs(model, tokens[1:] + [5], r)
    assert (lp - shifted).abs().max() > 1e-3


def test_right_padding_does_not_change_a_sample(model):
    data = make_train_data(4, seed=5)
    with torch.no_grad():
        batched, _ = response_log_probs(model, data["tokens"], data["response_lengths"])
        for i in range(4):
            (alone,), _ = response_log_probs(model, [data["tokens"][i]], [data["response_lengths"][i]])
            torch.testing.assert_close(batched[i], alone, rtol=0, atol=1e-6)


def test_entropy_and_empty_response(model):
    from miles.algo.entropy import entropy_from_logits

    tokens = [[4, 5, 6, 7], [8, 9, 10]]
    with torch.no_grad():
        lps, ents = response_log_probs(model, tokens, [2, 0], entropy_fn=entropy_from_logits)
    assert lps[1].shape == (0,) and ents[1].shape == (0,)
    # the entropy of a distribution over 32 tokens lies in (0, log 32]
    assert ((ents[0] > 0) & (ents[0] <= torch.log(torch.tensor(32.0)) + 1e-5)).all()


def test_a_response_without_prompt_is_rejected(model):
    with pytest.raises(ValueError, match="prompt token"):
        response_log_probs(model, [[4, 5]], [2])


def test_pad_right():
    ids, mask = pad_right([[5, 6, 7], [8]], pad_id=0)
    assert ids.tolist() == [[5, 6, 7], [8, 0, 0]]
    assert mask.tolist() == [[1, 1, 1], [1, 0, 0]]
