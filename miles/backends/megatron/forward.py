"""Packed batches on megatron-core without TransformerEngine: block-diagonal causal attention.

megatron-core's packed `thd` attention (`PackedSeqParams`) needs TransformerEngine; its local
`DotProductAttention` asserts on it. So a `PackedBatch` is run as one `[1, T]` sequence with an
explicit boolean mask `[1, 1, T, T]` (True = masked) that lets a token see only earlier tokens of its
own sample, and per-sample position ids (RoPE). This reproduces per-sample logits to float rounding;
the mask is O(T^2), which is the price of packing without TE (a GPU build with TE would pass
`PackedSeqParams` instead).

The stream is padded at the end to a multiple of `pad_multiple` (the TP size, which sequence
parallelism needs) with token 0 as one extra pseudo-sample that only attends to itself.

Log-probs: the logits at position t predict token t + 1, so sample b's response tokens (the last r_b
of tokens[cu[b]:cu[b+1]]) are scored by the logits at rows cu[b+1] - r_b - 1 .. cu[b+1] - 2.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from miles.backends.base import PackedBatch


@dataclass
class StreamInputs:
    """One packed micro-batch as megatron-core's GPTModel takes it, plus where its responses are."""

    input_ids: torch.Tensor  # int64 [1, T]
    position_ids: torch.Tensor  # int64 [1, T]
    attention_mask: torch.Tensor  # bool [1, 1, T, T], True = masked
    rows: torch.Tensor  # int64 [R]: logit row scoring each response token
    targets: torch.Tensor  # int64 [R]: the response tokens


def stream_inputs(batch: PackedBatch, *, pad_multiple: int = 1) -> StreamInputs:
    tokens, cu = batch.tokens, batch.cu_seqlens
    n = int(tokens.numel())
    total = -(-n // pad_multiple) * pad_multiple
    lengths = (cu[1:] - cu[:-1]).tolist()
    if total > n:
        lengths.append(total - n)
        tokens = torch.cat([tokens, tokens.new_zeros(total - n)])
    seg = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    starts = torch.repeat_interleave(torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)[:-1].tolist())),
                                     torch.tensor(lengths))
    positions = torch.arange(total) - starts
    causal = torch.ones(total, total, dtype=torch.bool).triu(1)
    mask = causal | (seg[:, None] != seg[None, :])
    ends = cu[1:].cpu()
    resp = batch.response_lengths.cpu()
    rows = torch.cat([torch.arange(int(e) - int(r) - 1, int(e) - 1) for e, r in zip(ends, resp)]) if len(resp) else torch.zeros(0, dtype=torch.long)
    device = batch.tokens.device
    return StreamInputs(
        input_ids=tokens.unsqueeze(0), position_ids=positions.unsqueeze(0).to(device),
        attention_mask=mask[None, None].to(device), rows=rows.to(device), targets=tokens[rows + 1],
    )


def response_log_probs(logits: torch.Tensor, inputs: StreamInputs, *, vocab_size: int, temperature: float,
                       with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs [R] (and entropy [R]) of the response tokens from full-vocabulary logits [1, T, V_pad].

    The vocabulary padding columns are dropped before the softmax; logits are divided by the rollout
    temperature (0, greedy, counts as 1), so trainer and engine score the same distribution.
    """
    from miles.algo.entropy import entropy_from_logits
    from miles.backends.torch.forward import scale_logits_by_temperature

    step = scale_logits_by_temperature(logits[0, inputs.rows, :vocab_size].float(), temperature)
    lp = step.gather(-1, inputs.targets.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(step, dim=-1)
    return lp, (entropy_from_logits(step) if with_entropy else None)
