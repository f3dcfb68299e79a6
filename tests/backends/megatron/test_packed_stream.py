"""The layouts megatron runs without TransformerEngine: the packed stream (block-diagonal mask) and
padded rows, with their positions and scored rows.

Hand-built: two samples of 3 and 4 tokens (responses of 1 and 2 tokens), padded to a multiple of 4.
No megatron-core here; the numbers follow from the rule in miles/backends/megatron/forward.py.
"""

from __future__ import annotations

import torch

from miles.backends.base import PackedBatch
from miles.backends.megatron.forward import cheaper_layout, response_log_probs, stream_inputs


def _batch() -> PackedBatch:
    return PackedBatch(tokens=torch.tensor([5, 6, 7, 8, 9, 10, 11]), cu_seqlens=torch.tensor([0, 3, 7]),
                       response_lengths=torch.tensor([1, 2]), loss_mask=torch.ones(3))


def test_mask_positions_and_rows_by_hand():
    s = stream_inputs(_batch(), pad_multiple=4)
    assert s.input_ids.tolist() == [[5, 6, 7, 8, 9, 10, 11, 0]]  # one pad token, its own pseudo-sample
    assert s.position_ids.tolist() == [[0, 1, 2, 0, 1, 2, 3, 0]]
    visible = (~s.attention_mask[0, 0]).int().tolist()
    assert visible == [
        [1, 0, 0, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0, 0, 0],
        [0, 0, 0, 1, 0, 0, 0, 0],
        [0, 0, 0, 1, 1, 0, 0, 0],
        [0, 0, 0, 1, 1, 1, 0, 0],
        [0, 0, 0, 1, 1, 1, 1, 0],
        [0, 0, 0, 0, 0, 0, 0, 1],
    ]
    # Sample 0's response (token 7) is predicted at row 1; sample 1's (10, 11) at rows 4 and 5.
    assert s.rows.tolist() == [1, 4, 5] and s.targets.tolist() == [7, 10, 11]


def test_log_probs_drop_vocab_padding_and_divide_by_temperature():
    s = stream_inputs(_batch(), pad_multiple=1)
    logits = torch.randn(1, 7, 14)
    logits[..., 12:] = 50.0  # padding columns: must not take part in the softmax
    lp, ent = response_log_probs(logits, s, vocab_size=12, temperature=0.5, with_entropy=True)
    want = torch.log_softmax(logits[0, [1, 4, 5], :12] / 0.5, -1)[torch.arange(3), torch.tensor([7, 10, 11])]
    assert torch.allclose(lp, want, atol=1e-6)
    p = torch.softmax(logits[0, [1, 4, 5], :12] / 0.5, -1)
    assert torch.allclose(ent, -(p * p.log()).sum(-1), atol=1e-5)
    greedy, _ = response_log_probs(logits, s, vocab_size=12, temperature=0.0, with_entropy=False)
    assert torch.allclose(greedy, torch.log_softmax(logits[0, [1, 4, 5], :12], -1)[torch.arange(3), torch.tensor([7, 10, 11])])


def test_padded_rows_positions_and_scored_positions_by_hand():
    s = stream_inputs(_batch(), pad_multiple=4, layout="padded")
    assert s.input_ids.tolist() == [[5, 6, 7, 0], [8, 9, 10, 11]]  # right-padded to 4 (a multiple of 4)
    assert s.position_ids.tolist() == [[0, 1, 2, 3], [0, 1, 2, 3]]
    assert (~s.attention_mask[0, 0]).int().tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]]
    # Sample 0's response (7) is predicted at column 1 of row 0; sample 1's (10, 11) at columns 1, 2 of row 1.
    assert s.seqs.tolist() == [0, 1, 1] and s.rows.tolist() == [1, 1, 2] and s.targets.tolist() == [7, 10, 11]
    logits = torch.randn(2, 4, 12)
    lp, _ = response_log_probs(logits, s, vocab_size=12, temperature=1.0, with_entropy=False)
    want = torch.log_softmax(logits[[0, 1, 1], [1, 1, 2]], -1)[torch.arange(3), torch.tensor([7, 10, 11])]
    assert torch.allclose(lp, want, atol=1e-6)


def test_many_short_samples_take_the_padded_layout_a_few_long_ones_the_stream():
    many = PackedBatch(tokens=torch.arange(256 * 12) % 19, cu_seqlens=torch.arange(257) * 12,
                       response_lengths=torch.full((256,), 4), loss_mask=torch.ones(1024))
    assert cheaper_layout(many, 64) == "padded" and stream_inputs(many, layout="padded").input_ids.shape == (256, 12)
    uneven = PackedBatch(tokens=torch.arange(203) % 19, cu_seqlens=torch.tensor([0, 200, 203]),
                         response_lengths=torch.tensor([4, 1]), loss_mask=torch.ones(5))
    assert cheaper_layout(uneven, 64) == "packed"


def test_packed_seq_params_carry_the_sample_boundaries_and_the_padding_segment():
    """What TransformerEngine gets instead of the mask (thd): samples 3 and 4 tokens long, then the pad
    token as its own 1-token segment, so no real token attends to it or it to them."""
    p = stream_inputs(_batch(), pad_multiple=4).packed_seq_params()
    assert p.qkv_format == "thd" and p.cu_seqlens_q.dtype == torch.int32
    assert p.cu_seqlens_q.tolist() == p.cu_seqlens_kv.tolist() == [0, 3, 7, 8]
    assert (p.max_seqlen_q, p.max_seqlen_kv) == (4, 4)
    assert stream_inputs(_batch(), pad_multiple=1).packed_seq_params().cu_seqlens_q.tolist() == [0, 3, 7]
