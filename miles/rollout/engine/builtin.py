"""The built-in rollout engine: batched, KV-cached sampling from a Hugging Face causal LM, in torch.

`BuiltinEngine` implements `RolloutEngine` (see `base.py`) without any server, so the embedded
default (and every test) runs the real rollout control flow on a CPU. It is not a throughput engine
like SGLang: no continuous batching, no paged KV cache, no prefix cache across calls, no CUDA graphs.

How one `generate(requests)` call runs:

1. Requests are sorted by prompt length (then ids) and cut into batches of `max_batch_size`: less
   padding, and the copies of a prompt land in the same batch.
2. A batch is left-padded, with an attention mask and position ids counted from each prompt's
   first real token (so a padded prompt sees the same positions as when it runs alone). When every
   prompt in the batch has the same length the mask is omitted (faster, same result).
3. Prefill runs the model once over the distinct prompts into a `DynamicCache` (the
   `n_samples_per_prompt` copies of a prompt share one prefill; their cache rows are copied), then
   each decode step feeds one new token per row and reuses the cache (our loop, not `model.generate`).
4. Sampling per row: greedy when temperature == 0, else temperature, top-k (-1 = off), top-p, drawn
   with the "exponential race" `argmax(p / E)`, E ~ Exp(1) i.i.d., which picks token i with
   probability p_i. E is counter-based: `-log(u)` with u from the SplitMix64 hash of
   (row key, step, token id), computed for the whole batch in a few integer tensor ops. A request's
   key is its `seed`, so a seeded request gets the same tokens whatever else is in the batch (and on
   any device: the hash is exact integer math); unseeded rows get keys drawn from the engine's
   generator (seeded by `seed=`), so a whole run is reproducible given the same calls. (A
   `torch.Generator` per seeded request would cost one kernel call per row per step.)
5. A row finishes on a stop token (the model's eos ids plus `stop_token_ids`; kept in `output_ids`),
   a stop string (matched on the decoded tail of the response; kept in `text`), `max_new_tokens`
   ("length"), or `pause_generation()` ("abort"). Finished rows are dropped from the batch (and
   its KV cache) once a quarter of the rows have finished, so long tails do not pay for short ones.
6. Log-probs: see `base.py` (`log_softmax(logits / T)` of the chosen token; T = 1 for greedy;
   `return_original_logprob=True` gives T = 1 always).

Usage:

    from miles.rollout.engine.builtin import BuiltinEngine
    from miles.rollout.engine.base import GenerateRequest, SamplingParams
    engine = BuiltinEngine("runs/tiny/hf", max_batch_size=64, seed=0)
    [resp] = engine.generate([GenerateRequest([7, 14, 9, 17], SamplingParams(max_new_tokens=4), True)])
    resp.output_ids, resp.output_token_logprobs, resp.finish_reason

Thread-safety: `generate` may be called from several threads (e.g. a Ray actor with concurrency);
the calls run one after another. `pause_generation`, `begin_weight_update` and `health` may be
called while a generation runs.
"""

from __future__ import annotations

import inspect
import os
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import torch

from miles.errors import UserError
from miles.rollout.engine.base import (
    FinishType,
    GenerateRequest,
    GenerateResponse,
    RolloutEngine,
    SamplingParams,
    weights_checksum,
)

# Drop finished rows from the batch once this fraction of the current rows has finished: compacting
# the KV cache costs a copy, so doing it after every single finished row is slower on short outputs.
_COMPACT_FRACTION = 0.25
# Tokens decoded past the longest stop string when looking for it in the response's tail: a token
# can decode to nothing on its own (a partial UTF-8 byte), so the tail must be a little longer.
_STOP_TAIL_SLACK = 4


class _Row:
    """Per-request decoding state (one row of the batch)."""

    __slots__ = ("req", "out", "out_len", "logprobs", "finish", "matched", "stop_ids")

    def __init__(self, req: GenerateRequest, eos_ids: frozenset[int]):
        self.req = req
        self.out: list[int] = []
        self.out_len = 0
        self.logprobs: list[float] = []
        self.finish: FinishType | None = None
        self.matched: int | str | None = None
        self.stop_ids = eos_ids | frozenset(req.sampling_params.stop_token_ids or ())


class BuiltinEngine(RolloutEngine):
    """Batched KV-cached decoding of a local Hugging Face causal LM. See the module docstring."""

    def __init__(
        self,
        hf_dir: str | os.PathLike[str],
        *,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        max_batch_size: int = 256,
        seed: int = 0,
        attn_implementation: str = "sdpa",
        return_original_logprob: bool = False,
        wait_timeout_s: float = 600.0,
    ):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        hf_path = Path(hf_dir)
        if not (hf_path / "config.json").is_file():
            raise UserError(
                f"--hf-checkpoint {hf_path} has no config.json; point it at a local Hugging Face model "
                "directory (the built-in engine never downloads).",
                option="--hf-checkpoint",
            )
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self.hf_dir = hf_path
        self.device = torch.device(device)
        self.dtype = dtype
        self.max_batch_size = max_batch_size
        self.return_original_logprob = return_original_logprob
        self.wait_timeout_s = wait_timeout_s

        self.tokenizer = AutoTokenizer.from_pretrained(hf_path, local_files_only=True)
        self.model = AutoModelForCausalLM.from_pretrained(
            hf_path, dtype=dtype, attn_implementation=attn_implementation, local_files_only=True
        ).to(self.device)
        self.model.eval()
        self.model.requires_grad_(False)
        # transformers renamed `past_key_values` to `cache` during 5.x; use whichever this one takes.
        forward_args = inspect.signature(self.model.forward).parameters
        self._cache_kw = "cache" if "cache" in forward_args else "past_key_values"
        # Every name a trainer may send, tied weights included (lm_head.weight is embed_tokens.weight).
        self._params = dict(self.model.named_parameters(remove_duplicate=False))

        eos = self.model.generation_config.eos_token_id
        if eos is None:
            eos = self.model.config.eos_token_id
        eos_ids = set([eos] if isinstance(eos, int) else (eos or []))
        if self.tokenizer.eos_token_id is not None:
            eos_ids.add(self.tokenizer.eos_token_id)
        self.eos_token_ids = frozenset(eos_ids)
        pad = self.tokenizer.pad_token_id
        self.pad_token_id = pad if pad is not None else min(self.eos_token_ids, default=0)

        # CPU: it only draws the sampling keys of unseeded requests, a few integers per batch.
        self._generator = torch.Generator().manual_seed(seed)
        self.weight_version: int = 0

        # Pause / weight-update state, guarded by one condition variable.
        self._cond = threading.Condition()
        self._paused = False
        self._updating = False
        self._in_flight = 0
        self._model_lock = threading.Lock()
        self._stats = {"requests": 0, "generated_tokens": 0, "generate_seconds": 0.0}

    # ------------------------------------------------------------------ generation

    def generate(self, requests: list[GenerateRequest]) -> list[GenerateResponse]:
        if not requests:
            return []
        requests = [r if isinstance(r, GenerateRequest) else GenerateRequest.from_json(r) for r in requests]
        self._enter_generation()
        start = time.perf_counter()
        try:
            # One generation at a time: on a CPU a second one only competes for the same cores, and
            # the engine's generator must be consumed in call order for runs to be reproducible.
            if not self._model_lock.acquire(timeout=self.wait_timeout_s):
                raise TimeoutError(
                    f"generate() waited {self.wait_timeout_s:.0f} s for another generate() call to finish"
                )
            # Sorting by (length, ids) keeps padding small and a prompt's copies in one batch (they
            # share a prefill); results are put back in request order.
            order = sorted(range(len(requests)), key=lambda i: (len(requests[i].input_ids), requests[i].input_ids))
            results: list[GenerateResponse | None] = [None] * len(requests)
            try:
                for lo in range(0, len(order), self.max_batch_size):
                    chunk = order[lo : lo + self.max_batch_size]
                    for i, resp in zip(chunk, self._generate_batch([requests[i] for i in chunk])):
                        results[i] = resp
            finally:
                self._model_lock.release()
        finally:
            with self._cond:
                self._in_flight -= 1
                self._cond.notify_all()
        out = [r for r in results if r is not None]
        self._stats["requests"] += len(out)
        self._stats["generated_tokens"] += sum(r.completion_tokens for r in out)
        self._stats["generate_seconds"] += time.perf_counter() - start
        return out

    def _enter_generation(self) -> None:
        with self._cond:
            ok = self._cond.wait_for(lambda: not self._paused and not self._updating, self.wait_timeout_s)
            if not ok:
                raise TimeoutError(
                    f"generate() waited {self.wait_timeout_s:.0f} s for the engine to leave "
                    f"{'pause_generation()' if self._paused else 'a weight update'}; "
                    "continue_generation() / end_weight_update() was never called"
                )
            self._in_flight += 1

    @torch.inference_mode()
    def _generate_batch(self, requests: list[GenerateRequest]) -> list[GenerateResponse]:
        dev = self.device
        rows = [_Row(r, self.eos_token_ids) for r in requests]
        version = self.weight_version
        for row in rows:
            if row.req.sampling_params.max_new_tokens == 0:
                row.finish = "length"
        active = [row for row in rows if row.finish is None]
        if active:
            self._decode(active)
        return self._responses(rows, version)

    def _decode(self, rows: list[_Row]) -> None:
        """Prefill then decode `rows` until each finishes; fills row.out / row.logprobs / row.finish.

        Bookkeeping is vectorised: every live row is at the same step, so step k's tokens go to
        column k of one [rows, max_new] buffer, and only rows that may finish (a stop id of any row,
        their length limit, or a stop string to look for) are examined in Python.
        """
        from transformers import DynamicCache

        dev = self.device
        n = len(rows)
        # A rollout sends each prompt n_samples_per_prompt times: prefill each distinct prompt once
        # and copy its KV cache to the rows that share it.
        distinct: dict[tuple[int, ...], int] = {}
        share = [distinct.setdefault(tuple(row.req.input_ids), len(distinct)) for row in rows]
        prompts = [list(p) for p in distinct]
        lens = [len(p) for p in prompts]
        width = max(lens)
        padded = any(k != width for k in lens)
        # One tensor from padded lists: a torch.tensor per row costs more than the model at batch 256.
        pad = self.pad_token_id
        input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], dtype=torch.long).to(dev)
        mask = torch.tensor([[0] * (width - k) + [1] * k for k in lens], dtype=torch.long).to(dev)
        # Positions count real tokens only, so a left-padded prompt sees the positions it would alone.
        positions = (mask.cumsum(-1) - 1).clamp_(min=0)
        cache = DynamicCache(config=self.model.config)
        logits = self.model(
            input_ids=input_ids,
            attention_mask=mask if padded else None,
            position_ids=positions,
            **{self._cache_kw: cache},
            use_cache=True,
            logits_to_keep=1,
        ).logits[:, -1]
        if len(prompts) < n:
            idx = torch.tensor(share, dtype=torch.long, device=dev)
            cache.batch_select_indices(idx)
            logits, mask, positions = logits[idx], mask[idx], positions[idx]
        next_pos = positions[:, -1:] + 1
        params = BatchParams.build(rows, dev, self._generator)

        limits = [row.req.sampling_params.max_new_tokens for row in rows]
        tok_buf = torch.zeros((n, max(limits)), dtype=torch.long)
        lp_buf = torch.zeros((n, max(limits)), dtype=torch.float32)
        stop_union = torch.tensor(sorted(set().union(*(row.stop_ids for row in rows))), dtype=torch.long)
        # Batch position -> index into `rows`; changes only when finished rows are dropped.
        orig = list(range(n))
        orig_t = torch.arange(n)
        limits_t = torch.tensor(limits)
        live = torch.ones(n, dtype=torch.bool)
        with_strings = [j for j, row in enumerate(rows) if row.req.sampling_params.stop]
        n_live = n
        step = 0
        while True:
            tokens, logprobs = sample_next(logits, params, step, self.return_original_logprob)
            tokens_cpu = tokens.cpu()
            tok_buf[orig_t, step] = tokens_cpu
            lp_buf[orig_t, step] = logprobs.float().cpu()
            maybe = (torch.isin(tokens_cpu, stop_union) | (limits_t[orig_t] <= step + 1)) & live
            candidates = set(maybe.nonzero().flatten().tolist()) | {j for j in with_strings if live[j]}
            for j in sorted(candidates):
                row = rows[orig[j]]
                if self._finished(row, tok_buf[orig[j]], step + 1):
                    live[j] = False
                    n_live -= 1
            if n_live == 0:
                break
            if self._paused:
                for j in live.nonzero().flatten().tolist():
                    rows[orig[j]].finish, rows[orig[j]].out_len = "abort", step + 1
                break
            n_dead = len(orig) - n_live
            if n_dead and n_dead >= _COMPACT_FRACTION * len(orig):
                keep = live.nonzero().flatten()
                idx = keep.to(dev)
                cache.batch_select_indices(idx)
                tokens, mask, next_pos = tokens[idx], mask[idx], next_pos[idx]
                params = params.select(idx)
                keep_l = keep.tolist()
                orig = [orig[j] for j in keep_l]
                orig_t = orig_t[keep]
                live = torch.ones(len(orig), dtype=torch.bool)
                with_strings = [j for j, o in enumerate(orig) if rows[o].req.sampling_params.stop]
            if padded:
                mask = torch.cat([mask, mask.new_ones((mask.shape[0], 1))], dim=1)
            logits = self.model(
                input_ids=tokens[:, None],
                attention_mask=mask if padded else None,
                position_ids=next_pos,
                **{self._cache_kw: cache},
                use_cache=True,
            ).logits[:, -1]
            next_pos = next_pos + 1
            step += 1

        toks, lps = tok_buf.tolist(), lp_buf.tolist()
        for i, row in enumerate(rows):
            row.out, row.logprobs = toks[i][: row.out_len], lps[i][: row.out_len]

    def _finished(self, row: _Row, tokens: torch.Tensor, length: int) -> bool:
        """Decide whether `row` (with `tokens[:length]` generated) is done; record why."""
        sp = row.req.sampling_params
        tok = int(tokens[length - 1])
        if tok in row.stop_ids:
            row.finish, row.matched = "stop", tok
        elif sp.stop and (match := self._stop_string(sp, tokens[:length].tolist())) is not None:
            row.finish, row.matched = "stop", match
        elif length >= sp.max_new_tokens:
            row.finish = "length"
        else:
            return False
        row.out_len = length
        return True

    def _stop_string(self, sp: SamplingParams, out: list[int]) -> str | None:
        """The first of `sp.stop` found in the decoded tail of `out` (only new matches can end there)."""
        longest = max(len(s) for s in sp.stop)
        [tail] = self._decode_batch([out[-(longest + _STOP_TAIL_SLACK) :]], sp.skip_special_tokens)
        return next((s for s in sp.stop if s in tail), None)

    def _decode_batch(self, seqs: list[list[int]], skip_special_tokens: bool) -> list[str]:
        """`tokenizer.batch_decode`, calling the Rust tokenizer directly when there is one.

        The transformers wrapper converts every id through Python first, which costs more than the
        tiny model's whole decode step at batch 256; the result is the same string.
        """
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is None:
            return self.tokenizer.batch_decode(seqs, skip_special_tokens=skip_special_tokens)
        texts = backend.decode_batch(seqs, skip_special_tokens=skip_special_tokens)
        if getattr(self.tokenizer, "clean_up_tokenization_spaces", False):
            texts = [self.tokenizer.clean_up_tokenization(t) for t in texts]
        return texts

    def _responses(self, rows: list[_Row], version: int) -> list[GenerateResponse]:
        texts: list[str] = [""] * len(rows)
        for skip in (True, False):  # batch_decode (one Rust call) per skip_special_tokens value
            idx = [i for i, row in enumerate(rows) if row.req.sampling_params.skip_special_tokens == skip]
            if idx:
                decoded = self._decode_batch([rows[i].out for i in idx], skip)
                for i, text in zip(idx, decoded):
                    texts[i] = text
        return [
            GenerateResponse(
                output_ids=row.out,
                text=text,
                finish_type=row.finish or "abort",
                prompt_tokens=len(row.req.input_ids),
                weight_version=version,
                output_token_logprobs=row.logprobs if row.req.return_logprob else None,
                matched=row.matched,
                rid=row.req.rid,
            )
            for row, text in zip(rows, texts)
        ]

    # ------------------------------------------------------------------ control

    def pause_generation(self) -> None:
        with self._cond:
            self._paused = True

    def continue_generation(self) -> None:
        with self._cond:
            self._paused = False
            self._cond.notify_all()

    def begin_weight_update(self) -> None:
        with self._cond:
            if self._updating:
                raise RuntimeError("begin_weight_update() called twice without end_weight_update()")
            self._updating = True  # new generate() calls wait from here on
            if not self._cond.wait_for(lambda: self._in_flight == 0, self.wait_timeout_s):
                self._updating = False
                self._cond.notify_all()
                raise TimeoutError(
                    f"begin_weight_update() waited {self.wait_timeout_s:.0f} s for {self._in_flight} "
                    "in-flight generate() call(s) to finish; call pause_generation() first to abort them"
                )

    def update_weights_from_tensors(
        self, named_tensors: list[tuple[str, torch.Tensor]], *, flush: bool = True
    ) -> None:
        if not self._updating:
            raise RuntimeError("update_weights_from_tensors() must run between begin_weight_update() and end")
        with torch.no_grad():
            for name, tensor in named_tensors:
                param = self._params.get(name)
                if param is None:
                    raise KeyError(
                        f"{name!r} is not a parameter of the rollout model ({self.hf_dir}); "
                        f"expected Hugging Face names like {next(iter(self._params))!r}"
                    )
                if param.shape != tensor.shape:
                    raise ValueError(f"{name}: got shape {tuple(tensor.shape)}, the model has {tuple(param.shape)}")
                param.copy_(tensor)  # casts to the engine dtype/device when they differ
        if flush:
            self.flush_cache()

    def end_weight_update(self, version: int) -> None:
        with self._cond:
            if not self._updating:
                raise RuntimeError("end_weight_update() called without begin_weight_update()")
            self.weight_version = int(version)
            self._updating = False
            self._cond.notify_all()

    def flush_cache(self) -> None:
        """No-op: the KV cache lives only for one `generate` call, so nothing outlives a weight update."""

    def health(self) -> dict[str, Any]:
        s = self._stats
        return {
            "ok": True,
            "engine": "builtin",
            "model": str(self.hf_dir),
            "device": str(self.device),
            "dtype": str(self.dtype).removeprefix("torch."),
            "weight_version": self.weight_version,
            "paused": self._paused,
            "updating": self._updating,
            "in_flight": self._in_flight,
            "requests": s["requests"],
            "generated_tokens": s["generated_tokens"],
            "tokens_per_s": s["generated_tokens"] / s["generate_seconds"] if s["generate_seconds"] else 0.0,
        }

    def named_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(Hugging Face name, tensor) for every parameter, tied ones listed once."""
        return self.model.named_parameters()

    def get_weights_checksum(self) -> str:
        return weights_checksum(self.named_parameters())


class BatchParams:
    """Sampling parameters of the rows in a batch, as tensors and flags (re-selected when rows drop)."""

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
    def build(cls, rows: list[_Row], device: torch.device, generator: torch.Generator) -> "BatchParams":
        sps = [row.req.sampling_params for row in rows]
        drawn = torch.randint(-(2**63), 2**63 - 1, (len(rows),), generator=generator, dtype=torch.int64).tolist()
        keys = [drawn[j] if sp.seed is None else _as_int64(sp.seed) for j, sp in enumerate(sps)]
        return cls(
            torch.tensor([sp.temperature for sp in sps], dtype=torch.float32, device=device),
            torch.tensor([sp.top_k for sp in sps], dtype=torch.long, device=device),
            torch.tensor([sp.top_p for sp in sps], dtype=torch.float32, device=device),
            torch.tensor(keys, dtype=torch.int64, device=device),
        )

    def select(self, idx: torch.Tensor) -> "BatchParams":
        temperature = torch.where(self.greedy, torch.zeros_like(self.temps), self.temps)
        return BatchParams(temperature[idx], self.top_k[idx], self.top_p[idx], self.keys[idx])


def sample_next(
    logits: torch.Tensor, p: BatchParams, step: int, original_logprob: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """(next token per row, its log-prob) for [rows, vocab] logits at decode `step`; see step 4 above."""
    logits = logits.float()
    if p.all_greedy:
        tokens = logits.argmax(dim=-1)
        return tokens, torch.log_softmax(logits, dim=-1).gather(1, tokens[:, None]).squeeze(1)
    scaled = logits if p.all_t1 else logits / p.temps[:, None]
    logp = torch.log_softmax(scaled, dim=-1)
    probs = logp.exp()
    if p.any_top_k:
        probs = _apply_top_k(probs, p.top_k)
    if p.any_top_p:
        probs = _apply_top_p(probs, p.top_p)
    tokens = (probs / exponential_noise(p.keys, step, probs.shape[-1])).argmax(dim=-1)
    if p.any_greedy:
        tokens = torch.where(p.greedy, logits.argmax(dim=-1), tokens)
    if original_logprob and not p.all_t1:
        logp = torch.log_softmax(logits, dim=-1)
    return tokens, logp.gather(1, tokens[:, None]).squeeze(1)


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


def exponential_noise(keys: torch.Tensor, step: int, vocab: int) -> torch.Tensor:
    """[rows, vocab] i.i.d. Exp(1) draws, a pure function of (key, step, token id).

    Row r, step s is the SplitMix64 stream seeded by mix64(key_r + s * golden): its i-th output
    becomes u = (top 23 bits + 0.5) / 2^23, exactly representable in float32 and strictly inside
    (0, 1), so E = -log(u) is never 0 or inf.
    """
    base = mix64(keys + _as_int64(step * _GOLDEN))
    counters = torch.arange(1, vocab + 1, device=keys.device, dtype=torch.int64) * _GOLDEN
    bits = _shr(mix64(base[:, None] + counters[None, :]), 41)
    return -torch.log((bits.float() + 0.5) * 2.0**-23)


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
