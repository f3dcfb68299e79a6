"""Index helpers of the packed token stream that a backend's forward needs.

A `PackedBatch` (miles/backends/base.py; built by `miles.train.packing.pack_samples`) concatenates
B samples; these give each token's position within its sample and the stream positions of the
response tokens, whose logits (one position earlier) score them.
"""

from __future__ import annotations

import torch

from miles.backends.base import PackedBatch


def position_ids(batch: PackedBatch) -> torch.Tensor:
    """int64 [T]: each sample's positions restart at 0 (what a packed HF forward needs)."""
    lengths = batch.cu_seqlens[1:] - batch.cu_seqlens[:-1]
    starts = torch.repeat_interleave(batch.cu_seqlens[:-1], lengths)
    return torch.arange(batch.tokens.numel(), device=batch.tokens.device) - starts


def response_positions(batch: PackedBatch) -> torch.Tensor:
    """int64 [R]: the stream position of every response token, in sample order.

    The logits at `response_positions(batch) - 1` predict the response tokens (causal shift).
    """
    sample = batch.sample_index_of_token
    offset_in_response = torch.arange(sample.numel(), device=sample.device) - batch.response_cu_seqlens[sample]
    return batch.cu_seqlens[sample + 1] - batch.response_lengths[sample] + offset_in_response
