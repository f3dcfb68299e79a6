"""The built-in engine's running batch on the fast decode path: rows in cache slots, state as tensors.

A `SlotBatch` holds the rows being decoded in slots 0..n-1 of a `decoder.SlotKV` cache, and per slot
as tensors: cache length, tokens generated, the sampled tokens and their log-probs so far, the stop
ids, max_new_tokens and the sampling settings. One step (`sample` then `decode`) costs a fixed number
of tensor ops whatever the batch size; Python touches rows only when they join, finish, carry stop
strings, or are aborted:

- `admit(rows)`: prefill their prompts (copies of one prompt share one prefill) into the next slots.
- `sample()`: one token per row (`sampler.sample_next`), written in place into the output buffers;
  stop ids and lengths are checked as tensors and come to the host as one small list per step;
  finished rows get their tokens and log-probs copied out and leave (`remove`).
- `remove(slots)`: the rows at the end of the batch move into the freed slots (a copy of those rows
  only), so the live rows stay 0..n-1 and finished rows are never decoded again.
- `decode()`: one forward for the live rows, each at its own cache column.

The engine (`miles.rollout.engine.builtin`) owns the scheduling: what to admit, aborts, futures.
Tests: tests/rollout/test_engine_builtin.py and tests/rollout/test_decoder.py.
"""

from __future__ import annotations

from typing import Callable

import torch

from miles.rollout.engine.decoder import Decoder, SlotKV
from miles.rollout.engine.sampler import BatchParams, sample_next, uniform_noise

# Per-slot tensors: name -> (dtype, fill value for new slots)
_ROW_STATE = {
    "lens": (torch.int64, 0),  # cache columns in use = the next token's column and rotary position
    "nout": (torch.int64, 0),  # tokens generated so far = the row's sampling step
    "max_new": (torch.int64, 0),
    "temperature": (torch.float32, 0.0),
    "top_k": (torch.int64, -1),
    "top_p": (torch.float32, 1.0),
    "keys": (torch.int64, 0),
}


class SlotBatch:
    """Rows being decoded on the fast path (see the module docstring)."""

    def __init__(
        self,
        decoder: Decoder,
        kv: SlotKV,
        *,
        pad_token_id: int,
        stop_string: Callable[[object, list[int]], str | None],
        original_logprob: bool = False,
    ):
        self.dec, self.kv = decoder, kv
        self.device = decoder.device
        self.pad_token_id = pad_token_id
        self.stop_string = stop_string
        self.original_logprob = original_logprob
        self.rows: list = []
        self.cap = 0
        self.out_cols = 0
        self.max_len = 0  # >= every live row's cache length
        self.max_out = 0  # >= every live row's generated count
        self.t: dict[str, torch.Tensor] = {}
        self.out_tok = torch.zeros((0, 0), dtype=torch.int64, device=self.device)
        self.out_lp = torch.zeros((0, 0), dtype=torch.float32, device=self.device)
        # noise[r, s] = uniform_noise(key of row r, s): each row's draws, computed when the row joins
        # (and for new columns when the buffers grow) instead of ~25 integer ops every step.
        self.noise = torch.zeros((0, 0), dtype=torch.float64, device=self.device)
        self.stop_ids = torch.zeros((0, 0), dtype=torch.int64, device=self.device)
        self.logits: torch.Tensor | None = None
        self.params: BatchParams | None = None
        self._stop_string_slots: list[int] = []

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def n_live(self) -> int:
        return len(self.rows)

    # ------------------------------------------------------------------ capacity

    def _ensure(self, rows: int, out_cols: int, stop_width: int) -> None:
        dev = self.device
        if rows > self.cap:
            cap = max(rows, 2 * self.cap)
            for name, (dtype, fill) in _ROW_STATE.items():
                grown = torch.full((cap,), fill, dtype=dtype, device=dev)
                if name in self.t:
                    grown[: self.cap] = self.t[name]
                self.t[name] = grown
            self.arange = torch.arange(cap, device=dev)
            self.cap = cap
        if out_cols > self.out_cols or self.out_tok.shape[0] < self.cap:
            old = self.out_cols
            cols = max(out_cols, 2 * self.out_cols, 8) if out_cols > self.out_cols else self.out_cols
            self.out_tok = _regrow(self.out_tok, self.cap, cols, 0)
            self.out_lp = _regrow(self.out_lp, self.cap, cols, 0.0)
            self.noise = _regrow(self.noise, self.cap, cols, 0.0)
            self.out_cols = cols
            n = len(self.rows)
            if n and cols > old:
                self.noise[:n, old:] = self._draws(self.t["keys"][:n], old, cols)
        if stop_width > self.stop_ids.shape[1] or self.stop_ids.shape[0] < self.cap:
            self.stop_ids = _regrow(self.stop_ids, self.cap, max(stop_width, self.stop_ids.shape[1]), -1)

    def reset(self) -> None:
        """Forget every row (buffers are kept): the start of a new batch, also after a failed step."""
        self.rows = []
        self.max_len = self.max_out = 0
        self.logits = None
        self._rebuild()

    def _rebuild(self) -> None:
        n, t = len(self.rows), self.t
        self.params = BatchParams(t["temperature"][:n], t["top_k"][:n], t["top_p"][:n], t["keys"][:n]) if n else None
        self._stop_string_slots = [j for j, row in enumerate(self.rows) if row.req.sampling_params.stop]

    def _draws(self, keys: torch.Tensor, first: int, last: int) -> torch.Tensor:
        steps = torch.arange(first, last, dtype=torch.int64, device=self.device)
        return uniform_noise(keys[:, None], steps[None, :])

    # ------------------------------------------------------------------ rows in and out

    def admit(self, rows: list) -> None:
        """Prefill `rows` into slots n..n+k-1; their next-token logits join `self.logits`."""
        n0, k = len(self.rows), len(rows)
        distinct: dict[tuple[int, ...], int] = {}
        share = [distinct.setdefault(tuple(row.req.input_ids), len(distinct)) for row in rows]
        prompts = list(distinct)
        plens = [len(p) for p in prompts]
        width = max(plens)
        stops = [sorted(row.stop_ids) for row in rows]
        sps = [row.req.sampling_params for row in rows]
        self._ensure(n0 + k, self.max_out + 1, max(len(s) for s in stops))
        self.kv.ensure(n0 + k, max(self.max_len, width) + 1)
        dev, pad = self.device, self.pad_token_id
        ids = torch.tensor([list(p) + [pad] * (width - len(p)) for p in prompts], dtype=torch.long).to(dev)
        last = torch.tensor([m - 1 for m in plens], dtype=torch.long).to(dev)
        src = torch.tensor(share, dtype=torch.long).to(dev)
        logits = self.dec.prefill_into(ids, last, self.kv, n0, src).index_select(0, src)
        self.logits = logits if n0 == 0 or self.logits is None else torch.cat([self.logits[:n0], logits])
        new = slice(n0, n0 + k)
        t = self.t
        values = {
            "lens": [plens[s] for s in share],
            "nout": [0] * k,
            "max_new": [sp.max_new_tokens for sp in sps],
            "temperature": [sp.temperature for sp in sps],
            "top_k": [sp.top_k for sp in sps],
            "top_p": [sp.top_p for sp in sps],
            "keys": [row.key for row in rows],
        }
        for name, vals in values.items():
            t[name][new] = torch.tensor(vals, dtype=t[name].dtype).to(dev)
        self.noise[new] = self._draws(t["keys"][new], 0, self.out_cols)
        sw = self.stop_ids.shape[1]
        if sw:
            self.stop_ids[new] = torch.tensor([s + [-1] * (sw - len(s)) for s in stops], dtype=torch.long).to(dev)
        self.rows += rows
        self.max_len = max(self.max_len, width)
        self._rebuild()

    def sample(self) -> list:
        """Sample one token per row; return the rows that finished (outputs filled in; they have left)."""
        n = len(self.rows)
        t = self.t
        self._ensure(n, self.max_out + 1, 0)
        steps = t["nout"][:n]
        noise = self.noise[:n].gather(1, steps[:, None]).squeeze(1)
        tokens, logprobs = sample_next(self.logits, self.params, steps, self.original_logprob, noise)
        rows_idx = self.arange[:n]
        self.out_tok.index_put_((rows_idx, steps), tokens)
        self.out_lp.index_put_((rows_idx, steps), logprobs.to(torch.float32))
        steps += 1
        self.max_out += 1
        at_length = steps >= t["max_new"][:n]
        if self.stop_ids.shape[1]:
            at_stop = (tokens[:, None] == self.stop_ids[:n]).any(dim=1)
            code = at_stop.long() * 2 + at_length.long()
        else:
            code = at_length.long()
        ss = self._stop_string_slots
        if ss:  # rows with stop strings need their tokens on the host: one transfer for both
            host = torch.stack([code, tokens]).tolist()
            codes, toks = host[0], host[1]
        else:
            codes = code.tolist()
        finished: dict[int, tuple[str, object]] = {j: ("stop", None) if c >= 2 else ("length", None) for j, c in enumerate(codes) if c}
        for j in ss:
            row = self.rows[j]
            row.out.append(toks[j])
            if codes[j] >= 2:
                continue
            match = self.stop_string(row.req.sampling_params, row.out)
            if match is not None:
                finished[j] = ("stop", match)
        if not finished:
            return []
        slots = sorted(finished)
        done = self._collect(slots)
        for j, row in zip(slots, done):
            reason, match = finished[j]
            row.finish = reason
            if reason == "stop":
                row.matched = row.out[-1] if match is None else match
        self.remove(slots)
        return done

    def abort(self, which: Callable[[object], bool]) -> list:
        """Finish the rows `which(row)` selects with "abort" (their output so far kept); they leave."""
        slots = [j for j, row in enumerate(self.rows) if which(row)]
        if not slots:
            return []
        done = self._collect(slots)
        for row in done:
            row.finish = "abort"
        self.remove(slots)
        return done

    def _collect(self, slots: list[int]) -> list:
        """Copy the tokens and log-probs of `slots` into their rows (`row.out`, `row.logprobs`)."""
        idx = torch.tensor(slots, dtype=torch.long).to(self.device)
        width = min(self.max_out, self.out_cols)
        counts = self.t["nout"].index_select(0, idx).tolist()
        toks = self.out_tok.index_select(0, idx)[:, :width].tolist()
        lps = self.out_lp.index_select(0, idx)[:, :width].tolist()
        rows = [self.rows[j] for j in slots]
        for row, c, tk, lp in zip(rows, counts, toks, lps):
            row.out, row.logprobs = tk[:c], lp[:c]
        return rows

    def remove(self, slots: list[int]) -> None:
        """Drop the rows in `slots`; the last live rows move into the freed slots."""
        n = len(self.rows)
        gone = set(slots)
        keep_n = n - len(gone)
        holes = [j for j in sorted(gone) if j < keep_n]
        movers = [j for j in range(keep_n, n) if j not in gone]
        if holes:
            dst = torch.tensor(holes, dtype=torch.long).to(self.device)
            src = torch.tensor(movers, dtype=torch.long).to(self.device)
            for buf in (*self.t.values(), self.out_tok, self.out_lp, self.noise, self.stop_ids, self.logits):
                buf.index_copy_(0, dst, buf.index_select(0, src))
            self.kv.move(dst, src, self.max_len + 1)
            for h, m in zip(holes, movers):
                self.rows[h] = self.rows[m]
        del self.rows[keep_n:]
        self.logits = self.logits[:keep_n]
        if keep_n:
            bounds = torch.stack([self.t["lens"][:keep_n].max(), self.t["nout"][:keep_n].max()]).tolist()
            self.max_len, self.max_out = bounds
        else:
            self.max_len = self.max_out = 0
        self._rebuild()

    # ------------------------------------------------------------------ forward

    def decode(self) -> None:
        """One forward for the live rows: each row's latest token at its own column; new logits."""
        n = len(self.rows)
        t = self.t
        nout, lens = t["nout"][:n], t["lens"][:n]
        last = self.out_tok[:n].gather(1, (nout - 1)[:, None]).squeeze(1)
        self.kv.ensure(n, self.max_len + 1)
        self.logits = self.dec.decode(last, lens, self.kv, self.max_len + 1)
        lens += 1
        self.max_len += 1


def _regrow(t: torch.Tensor, rows: int, cols: int, fill) -> torch.Tensor:
    grown = torch.full((rows, cols), fill, dtype=t.dtype, device=t.device)
    grown[: t.shape[0], : t.shape[1]] = t
    return grown
