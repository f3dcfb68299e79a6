"""The built-in engine's sampler: temperature, top-k, top-p and inverse-CDF draws, vectorised over rows.

`sample_next(logits, params, steps)` returns one token and its log-prob per row of a [rows, vocab]
logits tensor, with no per-row Python. Randomness is one float64 uniform per row, a pure function of
(the row's key, the row's own decode step) through SplitMix64 (`uniform_noise`), so a seeded request
draws the same tokens whatever else is in the batch, wherever its row sits and whenever it joined.
`BatchParams` holds the rows' sampling settings as tensors plus the flags that let the common cases
(all greedy, all at T = 1, no top-k/top-p) skip work.

Log-probs are `log_softmax(logits / T)` of the chosen token (T = 1 for greedy), before top-k/top-p,
as SGLang returns them; `original_logprob=True` gives `log_softmax(logits)` instead.

Used by `miles.rollout.engine.builtin` (both of its decode paths); tested in
tests/rollout/test_engine_builtin.py (`python -m pytest -q tests/rollout -k sampler`).
"""

from __future__ import annotations

import torch


class BatchParams:
    """Sampling parameters of the rows in a batch, as tensors and flags (re-selected when rows leave)."""

    def __init__(self, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, keys: torch.Tensor):
        self.greedy = temperature == 0
        # Greedy rows are argmax'd at the end; dividing their logits by 1 instead of 0 keeps them finite.
        self.temps = torch.where(self.greedy, torch.ones_like(temperature), temperature)
        self.top_k, self.top_p, self.keys = top_k, top_p, keys
        self.all_greedy = bool(self.greedy.all())
        self.any_greedy = bool(self.greedy.any())
        self.all_t1 = bool((self.temps == 1).all())
        self.any_top_k = bool((top_k > 0).any())
        self.any_top_p = bool((top_p < 1).any())

    @classmethod
    def build(cls, sps: list, keys: list[int], device: torch.device) -> "BatchParams":
        """From the rows' `SamplingParams` and sampling keys, in row order."""
        return cls(
            torch.tensor([sp.temperature for sp in sps], dtype=torch.float32, device=device),
            torch.tensor([sp.top_k for sp in sps], dtype=torch.long, device=device),
            torch.tensor([sp.top_p for sp in sps], dtype=torch.float32, device=device),
            torch.tensor(keys, dtype=torch.int64, device=device),
        )

    def _temperature(self) -> torch.Tensor:
        return torch.where(self.greedy, torch.zeros_like(self.temps), self.temps)

    def select(self, idx: torch.Tensor) -> "BatchParams":
        return BatchParams(self._temperature()[idx], self.top_k[idx], self.top_p[idx], self.keys[idx])

    def cat(self, other: "BatchParams") -> "BatchParams":
        return BatchParams(
            torch.cat([self._temperature(), other._temperature()]),
            torch.cat([self.top_k, other.top_k]),
            torch.cat([self.top_p, other.top_p]),
            torch.cat([self.keys, other.keys]),
        )


def sample_next(
    logits: torch.Tensor,
    p: BatchParams,
    steps: torch.Tensor | int,
    original_logprob: bool = False,
    noise: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(next token per row, its log-prob) for [rows, vocab] logits; row r is at decode step `steps[r]`.

    Inverse-CDF sampling: one uniform u per row from (key, step) picks the first token whose
    cumulative probability exceeds u x total, i.e. token i with probability p_i. The only random
    numbers are one per row (no rows x vocab noise tensor). `noise`, when given, must be
    `uniform_noise(p.keys, steps)` computed ahead (the fast path keeps a table per row).
    """
    logits = logits.float()
    if p.all_greedy:
        tokens = logits.argmax(dim=-1)
        return tokens, torch.log_softmax(logits, dim=-1).gather(1, tokens[:, None]).squeeze(1)
    if not torch.is_tensor(steps):
        steps = torch.full_like(p.keys, int(steps))
    if not p.any_top_k and not p.any_top_p:
        u = uniform_noise(p.keys, steps) if noise is None else noise
        return _sample_untruncated(logits, p, u, original_logprob)
    scaled = logits if p.all_t1 else logits / p.temps[:, None]
    logp = torch.log_softmax(scaled, dim=-1)
    probs = logp.exp()
    if p.any_top_k:
        probs = _apply_top_k(probs, p.top_k)
    if p.any_top_p:
        probs = _apply_top_p(probs, p.top_p)
    cdf = probs.double().cumsum(dim=-1)
    u = uniform_noise(p.keys, steps) if noise is None else noise
    target = u * cdf[:, -1]
    tokens = torch.searchsorted(cdf, target[:, None], right=True).squeeze(1).clamp_(max=probs.shape[-1] - 1)
    if p.any_greedy:
        tokens = torch.where(p.greedy, logits.argmax(dim=-1), tokens)
    if original_logprob and not p.all_t1:
        logp = torch.log_softmax(logits, dim=-1)
    return tokens, logp.gather(1, tokens[:, None]).squeeze(1)


# Vocabularies at least this large are searched in two levels (blocks of _BLOCK tokens, then one block).
_BLOCK = 128
_TWO_LEVEL_VOCAB = 4 * _BLOCK


def _sample_untruncated(
    logits: torch.Tensor, p: BatchParams, u: torch.Tensor, original_logprob: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """`sample_next` without top-k/top-p, in about half the passes over the vocabulary.

    Unnormalised weights w = exp(s - max s) (s = logits / T) are enough for the inverse CDF: the
    token is the first whose running sum of w exceeds u x sum(w). For a large vocabulary the running
    sum is taken over blocks of _BLOCK tokens first (float64 sums of float32 weights), then inside
    the one block that holds the target, so no [rows, vocab] float64 tensor is made. The log-prob is
    s[token] - max s - log sum(w), which is `log_softmax(s)[token]` computed the way log_softmax does.
    """
    rows, vocab = logits.shape
    s = logits if p.all_t1 else logits / p.temps[:, None]
    top, argmax = s.max(dim=-1)
    w = (s - top[:, None]).exp_()
    if vocab < _TWO_LEVEL_VOCAB:
        cdf = w.double().cumsum(dim=-1)
        total = cdf[:, -1]
        tokens = torch.searchsorted(cdf, (u * total)[:, None], right=True).squeeze(1).clamp_(max=vocab - 1)
    else:
        nb = -(-vocab // _BLOCK)
        if nb * _BLOCK != vocab:  # zero weights past the vocabulary: never drawn
            w = torch.nn.functional.pad(w, (0, nb * _BLOCK - vocab))
        blocks = w.view(rows, nb, _BLOCK)
        block_cdf = blocks.sum(dim=-1, dtype=torch.float64).cumsum_(dim=-1)
        total = block_cdf[:, -1]
        target = u * total
        b = torch.searchsorted(block_cdf, target[:, None], right=True).clamp_(max=nb - 1)  # [rows, 1]
        before = torch.where(b > 0, block_cdf.gather(1, (b - 1).clamp_(min=0)), 0.0)
        inner = blocks.gather(1, b[:, :, None].expand(rows, 1, _BLOCK)).squeeze(1).double().cumsum_(dim=-1)
        i = torch.searchsorted(inner, target[:, None] - before, right=True).clamp_(max=_BLOCK - 1)
        tokens = (b * _BLOCK + i).squeeze(1).clamp_(max=vocab - 1)
    if p.any_greedy:
        tokens = torch.where(p.greedy, argmax, tokens)
    logp = s.gather(1, tokens[:, None]).squeeze(1) - top - total.log().float()
    if original_logprob and not p.all_t1:
        logp = logits.gather(1, tokens[:, None]).squeeze(1) - torch.logsumexp(logits, dim=-1)
    return tokens, logp


# SplitMix64 (Steele, Lea, Flood 2014) constants, as signed int64 (torch has no uint64 arithmetic).
_GOLDEN = 0x9E3779B97F4A7C15 - 2**64
_MUL1 = 0xBF58476D1CE4E5B9 - 2**64
_MUL2 = 0x94D049BB133111EB - 2**64


def _as_int64(x: int) -> int:
    """`x` mod 2^64, as the signed int64 with the same bits."""
    x %= 2**64
    return x - 2**64 if x >= 2**63 else x


def _shr(z: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 bits (torch's `>>` is arithmetic: it copies the sign bit)."""
    return (z >> k) & ((1 << (64 - k)) - 1)


def mix64(z: torch.Tensor) -> torch.Tensor:
    """SplitMix64's output function on int64 tensors (multiplication wraps mod 2^64)."""
    z = (z ^ _shr(z, 30)) * _MUL1
    z = (z ^ _shr(z, 27)) * _MUL2
    return z ^ _shr(z, 31)


def uniform_noise(keys: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """One float64 uniform in [0, 1) per row, a pure function of (key, step).

    The draw is SplitMix64's first output from the state mix64(key + step x golden), top 53 bits:
    exact integer math, so the same (key, step) gives the same number on any device and in any batch.
    """
    base = mix64(keys + steps * _GOLDEN)
    return _shr(mix64(base + _GOLDEN), 11).double() * 2.0**-53


def _apply_top_k(probs: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Zero every probability below the row's k-th largest (rows with k <= 0 are untouched)."""
    vocab = probs.shape[-1]
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), torch.full_like(top_k, vocab))
    kth = probs.topk(int(k.max()), dim=-1).values.gather(1, (k - 1)[:, None])
    return probs.masked_fill(probs < kth, 0.0)


def _apply_top_p(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose mass reaches top_p (at least one token)."""
    sorted_p, order = probs.sort(dim=-1, descending=True)
    mass_before = sorted_p.cumsum(dim=-1) - sorted_p
    # Normalise by the row total: top-k may have removed mass already.
    drop = mass_before >= top_p[:, None] * sorted_p.sum(dim=-1, keepdim=True)
    drop &= (top_p < 1)[:, None]  # rounding in cumsum must not trim rows that asked for no top-p
    sorted_p = sorted_p.masked_fill(drop, 0.0)
    return torch.zeros_like(probs).scatter_(1, order, sorted_p)
