"""Packed batches on megatron-core without TransformerEngine: two layouts, chosen by cost.

megatron-core's packed `thd` attention (`PackedSeqParams`) needs TransformerEngine; its local
`DotProductAttention` asserts on it. So a `PackedBatch` meets megatron's dense attention in one of
the two layouts the torch backend uses too (`miles.backends.torch.forward.choose_layout`):

- "packed": one `[1, T]` sequence with an explicit boolean mask `[1, 1, T, T]` (True = masked) that
  lets a token see only earlier tokens of its own sample, and per-sample position ids (RoPE). The
  mask and the attention scores are O(T^2): cheap for a few long samples, ruinous for many short ones
  (256 samples of ~12 tokens: T = 3k, 50x the padded cost; the tiny recipe's train step took 6-12 s);
- "padded": `[B, L]` rows, each sample right-padded to the longest, positions 0..L-1 and one causal
  mask `[1, 1, L, L]` for every row (a real token never sees the padding after it).

Both reproduce per-sample logits to float rounding. With `--transformer-impl transformer_engine` (GPU)
the trainer passes the packed layout with `StreamInputs.packed_seq_params()` (`thd`, the samples'
`cu_seqlens`) and no mask instead: TE's attention takes the boundaries, not a mask. The sequence is padded at the end to a multiple of `pad_multiple` (the TP size, which
sequence parallelism needs); in the packed layout with token 0 as one extra pseudo-sample that only
attends to itself.

Log-probs (`response_log_probs`; under TP from each rank's vocabulary slice, vocab_parallel.py): the logits at position t predict token t + 1, so sample b's response tokens (the last r_b
of its tokens) are scored by the logits at positions len_b - r_b - 1 .. len_b - 2 of its row (packed:
at rows cu[b+1] - r_b - 1 .. cu[b+1] - 2 of the one stream).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from miles.backends.base import PackedBatch


@dataclass
class StreamInputs:
    """One packed micro-batch as megatron-core's GPTModel takes it, plus where its responses are."""

    input_ids: torch.Tensor  # int64 [B', S] (B' = 1 packed, B padded)
    position_ids: torch.Tensor  # int64 [B', S]
    attention_mask: torch.Tensor  # bool [1, 1, S, S], True = masked
    rows: torch.Tensor  # int64 [R]: position (in its sequence) of the logits scoring each response token
    targets: torch.Tensor  # int64 [R]: the response tokens
    seqs: torch.Tensor | None = None  # int64 [R]: the sequence of each response token (None: all in sequence 0)
    cu_seqlens: torch.Tensor | None = None  # int32 [N + 1]: packed layout, sample boundaries (the padding segment too)

    def packed_seq_params(self):
        """megatron-core's `PackedSeqParams(qkv_format="thd")` for the packed layout: TransformerEngine's
        attention then keeps every sample to itself (and restarts RoPE per sample) from the boundaries
        alone, with no [T, T] mask."""
        from megatron.core.packed_seq_params import PackedSeqParams

        if self.cu_seqlens is None:
            raise ValueError("PackedSeqParams need the packed layout")
        longest = int((self.cu_seqlens[1:] - self.cu_seqlens[:-1]).max())
        return PackedSeqParams(qkv_format="thd", cu_seqlens_q=self.cu_seqlens, cu_seqlens_kv=self.cu_seqlens,
                               max_seqlen_q=longest, max_seqlen_kv=longest)


def cheaper_layout(batch: PackedBatch, hidden_size: int) -> str:
    """"packed" or "padded", whichever costs less for this batch on a model of `hidden_size`."""
    from miles.backends.torch.forward import choose_layout

    return choose_layout((batch.cu_seqlens[1:] - batch.cu_seqlens[:-1]).tolist(), hidden_size)


def stream_inputs(batch: PackedBatch, *, pad_multiple: int = 1, layout: str = "packed") -> StreamInputs:
    """The megatron inputs of `batch` in `layout` ("packed" or "padded")."""
    if layout == "padded":
        return _padded_inputs(batch, pad_multiple)
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
    cu_seqlens = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)
    return StreamInputs(
        input_ids=tokens.unsqueeze(0), position_ids=positions.unsqueeze(0).to(device),
        attention_mask=mask[None, None].to(device), rows=rows.to(device), targets=tokens[rows + 1],
        cu_seqlens=cu_seqlens.to(device),
    )


def _padded_inputs(batch: PackedBatch, pad_multiple: int) -> StreamInputs:
    cu, device = batch.cu_seqlens.cpu(), batch.tokens.device
    lengths = cu[1:] - cu[:-1]
    longest = int(lengths.max()) if lengths.numel() else 1
    width = -(-longest // pad_multiple) * pad_multiple
    b = int(lengths.numel())
    seq_of_token = torch.repeat_interleave(torch.arange(b), lengths)
    col_of_token = torch.arange(int(cu[-1])) - cu[:-1][seq_of_token]
    ids = torch.zeros(b, width, dtype=torch.long)
    ids[seq_of_token, col_of_token] = batch.tokens.cpu()
    resp = batch.response_lengths.cpu()
    seqs = torch.repeat_interleave(torch.arange(b), resp)
    # sample s's response occupies columns len_s - r_s .. len_s - 1, scored one column earlier
    offset = torch.arange(int(resp.sum())) - torch.repeat_interleave(torch.cumsum(resp, 0) - resp, resp)
    rows = (lengths - resp)[seqs] + offset - 1
    return StreamInputs(
        input_ids=ids.to(device), position_ids=torch.arange(width).expand(b, width).to(device),
        attention_mask=torch.ones(width, width, dtype=torch.bool).triu(1)[None, None].to(device),
        rows=rows.to(device), targets=ids[seqs, rows + 1].to(device), seqs=seqs.to(device),
    )


def response_log_probs(logits: torch.Tensor, inputs: StreamInputs, *, vocab_size: int, temperature: float,
                       with_entropy: bool, tp_group=None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs [R] (and entropy [R]) of the response tokens from logits [B', S, V_local].

    `tp_group` None (TP=1): the logits hold the whole (padded) vocabulary. Otherwise they are this TP
    rank's slice of it (TP rank r: columns r * V_local ..) and the softmax runs over the group
    (vocab_parallel.py), so no rank builds a full-vocabulary tensor. The vocabulary padding columns are
    dropped before the softmax; logits are divided by the rollout temperature (0, greedy, counts as 1),
    so trainer and engine score the same distribution.
    """
    from miles.algo.entropy import entropy_from_logits
    from miles.backends.torch.forward import scale_logits_by_temperature

    seqs = 0 if inputs.seqs is None else inputs.seqs
    if tp_group is not None:
        import torch.distributed as dist

        from miles.backends.megatron.vocab_parallel import vocab_parallel_log_probs

        step = scale_logits_by_temperature(logits[seqs, inputs.rows].float(), temperature)
        return vocab_parallel_log_probs(step, inputs.targets, vocab_start=dist.get_rank(tp_group) * logits.shape[-1],
                                        vocab_size=vocab_size, group=tp_group, with_entropy=with_entropy)
    step = scale_logits_by_temperature(logits[seqs, inputs.rows, :vocab_size].float(), temperature)
    lp = step.gather(-1, inputs.targets.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(step, dim=-1)
    return lp, (entropy_from_logits(step) if with_entropy else None)
