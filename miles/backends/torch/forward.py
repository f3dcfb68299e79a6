"""The forward pass of a packed batch: per-response-token log-probs (and entropies) of a HF causal LM.

Alignment: a causal LM's logits at position t predict token t + 1, so the response tokens of a
sample (its last R tokens) are scored by the logits at the positions just before them. Only those
positions go through the LM head: `ResponseLogits` runs the decoder, gathers the hidden states that
predict response tokens and applies the head to them alone ([R, V] logits; the prompt's logits are
never built).

Layout: a `PackedBatch` is one token stream. How it meets the attention kernel is chosen per
micro-batch by cost (`choose_layout`):

- "packed": one row [1, T] with per-sample position ids and no attention mask; HF then builds a
  block-diagonal causal mask itself (needs `use_cache=False`). Attention work grows with T^2, so this
  wins only when lengths differ wildly (one long sample among short ones);
- "padded": B rows right-padded to the longest sample with a 0/1 attention mask; attention work
  grows with B * L_max^2. On CPU (eager / sdpa kernels, no varlen attention) this is usually cheaper.

Both give the same numbers up to float rounding (tests/backends/test_forward.py); the no-grad pass
that computes old log-probs and the training pass use the same layout for the same micro-batch, so
an on-policy ratio is exactly 1.

Temperature: the logits are divided by `--rollout-temperature` before the softmax (upstream's rule;
SGLang returns log-probs of `logits / temperature`), except at temperature 0 (greedy), where engines
return unscaled log-probs.

Use: `log_probs, entropy = response_log_probs(ResponseLogits(hf_model), batch, temperature=0.8)`.
"""

from __future__ import annotations

from typing import Literal

import torch

from miles.backends.base import PackedBatch
from miles.backends.packing import position_ids, response_positions

Layout = Literal["packed", "padded"]


def choose_layout(lengths: list[int], hidden_size: int) -> Layout:
    """The cheaper layout for sequences of `lengths` under a dense (non-varlen) attention kernel.

    Per token, the linear layers cost about 3 * hidden multiply-adds per hidden unit and attention
    about one per attended position, so a row of L tokens costs ~ L * (3 h + L).
    """
    total, longest = sum(lengths), max(lengths, default=0)
    packed = total * (3 * hidden_size + total)
    padded = len(lengths) * longest * (3 * hidden_size + longest)
    return "packed" if packed < padded else "padded"


class ResponseLogits(torch.nn.Module):
    """Wraps a HF causal LM: `forward(...)` returns the logits [R, V] that predict the response tokens.

    A module of its own so that DistributedDataParallel can wrap it (DDP must see the forward that
    produced the gradients); the HF model stays reachable as `.lm` with its own parameter names.
    """

    def __init__(self, lm: torch.nn.Module):
        super().__init__()
        self.lm = lm

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        position_ids: torch.Tensor | None,
        rows: torch.Tensor,
        cols: torch.Tensor,
    ) -> torch.Tensor:
        hidden = self.lm.base_model(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
        ).last_hidden_state
        logits = self.lm.get_output_embeddings()(hidden[rows, cols])
        cap = getattr(self.lm.config, "final_logit_softcapping", None)
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits


def layout_inputs(batch: PackedBatch, layout: Layout, pad_id: int = 0) -> dict[str, torch.Tensor | None]:
    """The keyword arguments of `ResponseLogits.forward` for `batch` in `layout`."""
    target = response_positions(batch)  # [R] stream positions of the response tokens
    if layout == "packed":
        return {
            "input_ids": batch.tokens.unsqueeze(0),
            "attention_mask": None,
            "position_ids": position_ids(batch).unsqueeze(0),
            "rows": torch.zeros_like(target),
            "cols": target - 1,
        }
    lengths = batch.cu_seqlens[1:] - batch.cu_seqlens[:-1]
    width = int(lengths.max()) if lengths.numel() else 0
    sample_of_stream = torch.repeat_interleave(torch.arange(lengths.numel(), device=lengths.device), lengths)
    col_of_stream = torch.arange(batch.tokens.numel(), device=lengths.device) - batch.cu_seqlens[sample_of_stream]
    ids = torch.full((lengths.numel(), width), pad_id, dtype=torch.long, device=batch.tokens.device)
    mask = torch.zeros_like(ids)
    ids[sample_of_stream, col_of_stream] = batch.tokens
    mask[sample_of_stream, col_of_stream] = 1
    sample = batch.sample_index_of_token
    return {
        "input_ids": ids,
        "attention_mask": mask,
        "position_ids": None,
        "rows": sample,
        "cols": target - batch.cu_seqlens[sample] - 1,
    }


def scale_logits_by_temperature(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """`logits / temperature`, the distribution the engine sampled from; temperature 0 (greedy) and 1
    return `logits` itself (engines report unscaled log-probs for greedy rows)."""
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if temperature == 0 or temperature == 1.0:
        return logits
    return logits / temperature


def log_probs_from_logits(
    logits: torch.Tensor, targets: torch.Tensor, *, temperature: float, with_entropy: bool, entropy_grad: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs [R] of `targets` under `logits` [R, V] / temperature, and the entropy [R] if asked."""
    from miles.algo.entropy import entropy_from_logits

    logits = scale_logits_by_temperature(logits.float(), temperature)
    # One fused log-softmax: its backward needs only its output, so the [R, V] logits can be freed
    # (the same memory a logsumexp-based gather would keep alive) and no op re-exponentiates them.
    logp = torch.log_softmax(logits, dim=-1)
    log_probs = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = None
    if with_entropy:
        if entropy_grad:
            entropy = entropy_from_logits(logits)
        else:
            with torch.no_grad():
                # H = -sum_v p_v log p_v from the log-softmax already computed. A -inf logit (a masked
                # vocabulary entry) gives 0 * -inf = NaN here; such rows take the careful formula.
                lp_ = logp.detach()
                entropy = -torch.linalg.vecdot(torch.exp(lp_), lp_)
                bad = ~torch.isfinite(entropy)
                if bad.any():
                    entropy[bad] = entropy_from_logits(logits.detach()[bad])
    return log_probs, entropy


def response_log_probs(
    net: torch.nn.Module,
    batch: PackedBatch,
    *,
    temperature: float,
    layout: Layout | None = None,
    with_entropy: bool = False,
    entropy_grad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs [R] (and entropies [R]) of the batch's response tokens; gradients flow unless disabled.

    `net` is a `ResponseLogits` (or a DDP wrapping one). `layout=None` picks the cheaper one.
    """
    if layout is None:
        hidden = _config_of(net).hidden_size
        layout = choose_layout((batch.cu_seqlens[1:] - batch.cu_seqlens[:-1]).tolist(), hidden)
    logits = net(**layout_inputs(batch, layout))
    targets = batch.tokens[response_positions(batch)]
    return log_probs_from_logits(logits, targets, temperature=temperature, with_entropy=with_entropy, entropy_grad=entropy_grad)


def _config_of(net: torch.nn.Module):
    inner = getattr(net, "module", net)  # DDP keeps the wrapped module as .module
    return inner.lm.config
