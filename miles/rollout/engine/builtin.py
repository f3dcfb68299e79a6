"""The built-in rollout engine: continuously batched, KV-cached sampling from a Hugging Face causal LM.

`BuiltinEngine` implements `RolloutEngine` (see `base.py`) in-process, so the embedded default (and
every test) runs the real rollout control flow on a CPU; `miles.rollout.engine.server` serves the same
object over SGLang's HTTP API. It is not a throughput engine like SGLang: no paged KV cache, no prefix
cache across requests, no CUDA graphs.

How requests run:

1. `submit(request)` queues a request and returns a future; `generate(requests)` is submit + wait.
   One scheduler thread owns the model and the running batch (at most `max_batch_size` rows).
2. Continuous batching: at every decode step, waiting requests are admitted into free slots and
   their prompts prefilled together (the `n_samples_per_prompt` copies of a prompt share one prefill).
   Two decode paths, chosen from `model.config.model_type` (`decode_path` in `health()`):
   - **fast** (Llama, Qwen2, Qwen3; `decoder.py` + `slot_batch.py`): our own forward over the HF
     model's own weight tensors, a KV cache preallocated per slot and grown geometrically, written
     in place; every row sits at its own cache column, so joining rows need no cache merge and
     finished rows leave at once (the last rows move into their slots) and are never decoded again.
     Tokens, log-probs and finish checks stay tensors; one small list reaches the host per step.
   - **hf** (every other architecture, or `decode_path="hf"`): Hugging Face's forward with a
     left-padded `DynamicCache` concatenated onto the running batch's; masks and position ids count
     each row's real tokens only, so a row sees the positions it would see alone.
3. Sampling (`sampler.py`): greedy when temperature == 0, else temperature, top-k (-1 = off), top-p,
   then inverse-CDF sampling with one uniform per row, a SplitMix64 hash of (row key, the row's own
   step) (`uniform_noise`). A request's key is its `seed`, so a seeded request gets the same tokens
   whatever else is in the batch and whenever it joined; unseeded requests get keys from the
   engine's generator (seeded by `seed=`) in submission order.
4. A row finishes on a stop token (the model's eos ids plus `stop_token_ids`; kept in `output_ids`),
   a stop string (matched on the decoded tail of the response; kept in `text`), `max_new_tokens`
   ("length"), `abort_request` or `pause_generation()` ("abort"). Its future resolves at once. Free
   slots are refilled an eighth of the batch at a time (each admission costs a prefill forward), or
   at once when everything waiting fits.
5. Log-probs: see `base.py` (`log_softmax(logits / T)` of the chosen token; T = 1 for greedy;
   `return_original_logprob=True` gives T = 1 always). A request with `max_new_tokens` 0,
   `return_logprob` and `logprob_start_len` gets its prompt's own log-probs instead (SGLang's
   `input_token_logprobs`, at the same T): how an on-policy distillation teacher scores samples.

Usage:

    from miles.rollout.engine.builtin import BuiltinEngine
    from miles.rollout.engine.base import GenerateRequest, SamplingParams
    engine = BuiltinEngine("runs/tiny/hf", max_batch_size=64, seed=0)
    future = engine.submit(GenerateRequest([7, 14, 9, 17], SamplingParams(max_new_tokens=4), True))
    resp = future.result(); resp.output_ids, resp.output_token_logprobs, resp.finish_reason

Thread-safety: every public method may be called from any thread.
"""

from __future__ import annotations

import collections
import inspect
import os
import threading
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path
from typing import Any, Iterator, Literal

import torch

from miles.errors import UserError
from miles.utils.hf_experts import FUSED_MODEL_TYPES, checkpoint_tensors, fused_slice, is_fused_expert
from miles.rollout.engine.base import (
    FinishType,
    GenerateRequest,
    GenerateResponse,
    RolloutEngine,
    SamplingParams,
    memory_tags,
    weights_checksum,
)
from miles.rollout.engine.decoder import Decoder, unsupported_reason
from miles.rollout.engine.slot_batch import SlotBatch
from miles.rollout.engine.sampler import (  # noqa: F401  (re-exported: the sampler used to live here)
    _GOLDEN,
    BatchParams,
    _apply_top_k,
    _apply_top_p,
    _as_int64,
    mix64,
    sample_next,
    uniform_noise,
)

# Finished rows leave the batch when waiting requests are admitted into their slots, or once this
# fraction of the batch has finished (compacting the KV cache costs a copy, so doing it after every
# single finished row is slower on short outputs).
_COMPACT_FRACTION = 0.25
# Tokens decoded past the longest stop string when looking for it in the response's tail: a token
# can decode to nothing on its own (a partial UTF-8 byte), so the tail must be a little longer.
_STOP_TAIL_SLACK = 4


class _Row:
    """Per-request decoding state (one row of the running batch)."""

    __slots__ = ("req", "out", "logprobs", "finish", "matched", "stop_ids", "future", "key", "abort", "seq")

    def __init__(self, req: GenerateRequest, eos_ids: frozenset[int], future: Future, key: int, seq: int = 0):
        self.req = req
        self.out: list[int] = []
        self.logprobs: list[float] = []
        self.finish: FinishType | None = None
        self.matched: int | str | None = None
        self.stop_ids = eos_ids | frozenset(req.sampling_params.stop_token_ids or ())
        self.future = future
        self.key = key
        self.abort = False
        self.seq = seq  # submission number: an abort reaches only requests submitted before it


class _Batch:
    """The running batch: rows, their KV cache, attention mask, next positions and next-token logits."""

    def __init__(self, rows, cache, mask, next_pos, logits, params, padded):
        self.rows: list[_Row] = rows
        self.cache = cache
        self.mask = mask  # [B, L] long, 1 = a real token in the cache
        self.next_pos = next_pos  # [B, 1] position of the next token
        self.logits = logits  # [B, V] distribution of each row's next token
        self.params: BatchParams = params
        self.padded = padded  # any 0 in mask (then the model needs it)
        self.live = [True] * len(rows)

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def n_live(self) -> int:
        return sum(self.live)

    def abort(self, which) -> list[_Row]:
        """Finish the live rows `which(row)` selects with "abort" (`row.out` is already up to date)."""
        done = []
        for j, row in enumerate(self.rows):
            if self.live[j] and which(row):
                row.finish = "abort"
                self.live[j] = False
                done.append(row)
        return done

    def select(self, keep: list[int]) -> None:
        idx = torch.tensor(keep, dtype=torch.long, device=self.mask.device)
        self.cache.batch_select_indices(idx)
        self.mask, self.next_pos, self.logits = self.mask[idx], self.next_pos[idx], self.logits[idx]
        self.params = self.params.select(idx)
        self.rows = [self.rows[j] for j in keep]
        self.live = [True] * len(keep)
        # Columns no remaining row uses (left padding of rows that left) are dropped from the cache.
        used = self.mask.any(dim=0).nonzero()
        first = int(used[0]) if len(used) else 0
        if first > 0:
            self.mask = self.mask[:, first:]
            for layer in self.cache.layers:
                layer.keys, layer.values = layer.keys[:, :, first:], layer.values[:, :, first:]
        self.padded = bool((self.mask == 0).any())

    def merge(self, other: "_Batch") -> None:
        """Append `other`'s rows; the shorter cache is left-padded (masked) to the longer one."""
        la, lb = self.mask.shape[1], other.mask.shape[1]
        width = max(la, lb)
        for mine, theirs in zip(self.cache.layers, other.cache.layers):
            mine.keys = torch.cat([_left_pad(mine.keys, width), _left_pad(theirs.keys, width)])
            mine.values = torch.cat([_left_pad(mine.values, width), _left_pad(theirs.values, width)])
        self.mask = torch.cat([_left_pad(self.mask, width, dim=1), _left_pad(other.mask, width, dim=1)])
        self.next_pos = torch.cat([self.next_pos, other.next_pos])
        self.logits = torch.cat([self.logits, other.logits])
        self.params = self.params.cat(other.params)
        self.rows += other.rows
        self.live += other.live
        self.padded = self.padded or other.padded or la != lb


def _left_pad(t: torch.Tensor, width: int, dim: int = 2) -> torch.Tensor:
    missing = width - t.shape[dim]
    if missing == 0:
        return t
    shape = list(t.shape)
    shape[dim] = missing
    return torch.cat([t.new_zeros(shape), t], dim=dim)


class BuiltinEngine(RolloutEngine):
    """Continuously batched, KV-cached decoding of a local Hugging Face causal LM. See the module docstring."""

    def __init__(
        self,
        hf_dir: str | os.PathLike[str],
        *,
        device: str | torch.device = "cpu",
        dtype: torch.dtype | str = torch.float32,
        max_batch_size: int = 256,
        seed: int = 0,
        attn_implementation: str = "sdpa",
        return_original_logprob: bool = False,
        wait_timeout_s: float = 600.0,
        decode_path: Literal["auto", "hf"] = "auto",
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
        self.dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype  # "bfloat16" as --rollout-dtype names it
        self.max_batch_size = max_batch_size
        self.return_original_logprob = return_original_logprob
        self.wait_timeout_s = wait_timeout_s

        self.tokenizer = AutoTokenizer.from_pretrained(hf_path, local_files_only=True)
        self.model = AutoModelForCausalLM.from_pretrained(
            hf_path, dtype=self.dtype, attn_implementation=attn_implementation, local_files_only=True
        ).to(self.device)
        self.model.eval()
        self.model.requires_grad_(False)
        # transformers renamed `past_key_values` to `cache` during 5.x; use whichever this one takes.
        forward_args = inspect.signature(self.model.forward).parameters
        self._cache_kw = "cache" if "cache" in forward_args else "past_key_values"
        # Every name a trainer may send, tied weights included (lm_head.weight is embed_tokens.weight).
        self._params = dict(self.model.named_parameters(remove_duplicate=False))
        # MoE experts transformers fuses in memory: SGLang knows only their checkpoint names (and drops
        # others), so this engine takes those (miles/utils/hf_experts.py) and refuses the fused ones.
        model_type = getattr(self.model.config, "model_type", None)
        self._fused_names = frozenset(n for n, p in self._params.items()
                                      if model_type in FUSED_MODEL_TYPES and is_fused_expert(n, p))
        # The fast decoder for the Llama family (decoder.py); other models run Hugging Face's forward.
        if decode_path not in ("auto", "hf"):
            raise ValueError(f"decode_path must be 'auto' or 'hf', got {decode_path!r}")
        reason = "decode_path='hf'" if decode_path == "hf" else unsupported_reason(self.model)
        self._decoder: Decoder | None = Decoder(self.model) if reason is None else None
        self.decode_path = "fast" if self._decoder is not None else "hf"
        self.decode_path_reason = reason  # why Hugging Face's forward runs (None on the fast path)
        # The fast path's batch: its KV cache and per-row buffers are kept between batches (they only grow).
        self._slots: SlotBatch | None = None

        eos = self.model.generation_config.eos_token_id
        if eos is None:
            eos = self.model.config.eos_token_id
        eos_ids = set([eos] if isinstance(eos, int) else (eos or []))
        if self.tokenizer.eos_token_id is not None:
            eos_ids.add(self.tokenizer.eos_token_id)
        self.eos_token_ids = frozenset(eos_ids)
        pad = self.tokenizer.pad_token_id
        self.pad_token_id = pad if pad is not None else min(self.eos_token_ids, default=0)

        # CPU: it only draws the sampling keys of unseeded requests, one integer per request.
        self._generator = torch.Generator().manual_seed(seed)
        self.weight_version: int = 0

        # Scheduler state, guarded by one condition variable. Requests submitted while paused or
        # during a weight update are held and join the queue when generation continues.
        self._cond = threading.Condition()
        self._waiting: collections.deque[_Row] = collections.deque()
        self._held: list[_Row] = []
        self._running = 0  # rows in the scheduler's batch (it owns the batch itself)
        self._paused = False
        self._updating = False
        # Aborts are bounded by submission number, so one that the scheduler gets to late (a busy
        # machine) cannot hit requests submitted after it: abort-all ends rows with seq < _abort_below,
        # a rid abort the rows with that prefix and seq < its bound.
        self._seq = 0
        self._abort_below = 0
        self._abort_rids: dict[str, int] = {}
        self._abort_all = False  # an abort is waiting for the scheduler
        self._model_lock = threading.Lock()
        self._admit_min = max(1, max_batch_size // 8)
        self._thread: threading.Thread | None = None
        self._stats = {"requests": 0, "generated_tokens": 0, "busy_seconds": 0.0}

    # ------------------------------------------------------------------ generation

    def submit(self, request: GenerateRequest | dict[str, Any]) -> Future:
        """Queue one request; the future resolves to its `GenerateResponse` as soon as it finishes."""
        req = request if isinstance(request, GenerateRequest) else GenerateRequest.from_json(request)
        reject_unsupported_sampling(req.sampling_params)
        future: Future = Future()
        future.set_running_or_notify_cancel()
        sp = req.sampling_params
        with self._cond:
            # Keys of unseeded requests come from the engine's generator in submission order, so a
            # run is reproducible given the same calls.
            key = _as_int64(sp.seed) if sp.seed is not None else int(
                torch.randint(-(2**63), 2**63 - 1, (1,), generator=self._generator, dtype=torch.int64)
            )
            row = _Row(req, self.eos_token_ids, future, key, self._seq)
            self._seq += 1
            if sp.max_new_tokens == 0:
                row.finish = "length"
                resp = self._responses([row], self.weight_version)[0]
                if req.return_logprob and req.logprob_start_len is not None:
                    resp.input_token_logprobs, resp.input_token_ids = self._score_prompt(req)
                future.set_result(resp)
                return future
            (self._held if self._paused or self._updating else self._waiting).append(row)
            self._ensure_thread()
            self._cond.notify_all()
        return future

    def _score_prompt(self, req: GenerateRequest) -> tuple[list[float | None], list[int]]:
        """The log-prob of every prompt token given the ones before it, from `req.logprob_start_len` on
        (SGLang's `input_token_logprobs`; position 0 gets None), at the request's temperature like the
        output log-probs. One forward of the whole prompt, outside the decode batch: the caller holds
        the lock, so no weight update runs under it."""
        sp = req.sampling_params
        temperature = sp.temperature if sp.temperature > 0 and not self.return_original_logprob else 1.0
        ids = torch.tensor([req.input_ids], dtype=torch.long, device=self.device)
        with torch.no_grad():
            logits = self.model(input_ids=ids).logits[0, :-1].float()
        lp = torch.log_softmax(logits / temperature, dim=-1).gather(-1, ids[0, 1:, None])[:, 0]
        start = max(0, int(req.logprob_start_len or 0))
        return ([None] + lp.tolist())[start:], list(req.input_ids[start:])

    def generate(self, requests: list[GenerateRequest]) -> list[GenerateResponse]:
        """Answer every request (same order); blocks while paused (up to `wait_timeout_s`)."""
        if not requests:
            return []
        if self._paused or self._updating:
            with self._cond:
                ok = self._cond.wait_for(lambda: not self._paused and not self._updating, self.wait_timeout_s)
            if not ok:
                raise TimeoutError(
                    f"generate() waited {self.wait_timeout_s:.0f} s for the engine to leave "
                    f"{'pause_generation()' if self._paused else 'a weight update'}; "
                    "continue_generation() / end_weight_update() was never called"
                )
        with self._cond:  # queue them all before the scheduler looks, so they are admitted together
            futures = [self.submit(r) for r in requests]
        deadline = time.monotonic() + self.wait_timeout_s
        out = []
        for f in futures:
            try:
                out.append(f.result(timeout=max(0.0, deadline - time.monotonic())))
            except FutureTimeout:
                raise TimeoutError(f"generate() waited {self.wait_timeout_s:.0f} s for {len(requests)} responses") from None
        return out

    def submitting_together(self) -> threading.Condition:
        """`with engine.submitting_together(): submit(...) ...`: requests submitted inside reach the
        scheduler as one batch, as `generate` admits its requests (the rollout manager's draws)."""
        return self._cond

    def abort_request(self, rid: str = "", abort_all: bool = False) -> None:
        """Finish matching requests now with finish_reason "abort" (SGLang: rid prefix match)."""
        with self._cond:
            if abort_all:
                self._abort_below = self._seq
                self._abort_all = True
            elif rid:
                self._abort_rids[rid] = self._seq
            self._cond.notify_all()

    def _ensure_thread(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._loop, name="miles-engine-scheduler", daemon=True)
            self._thread.start()

    def _loop(self) -> None:
        batch: _Batch | None = None
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._waiting or batch is not None or self._abort_all or self._abort_rids)
                abort_all, below, rids = self._abort_all, self._abort_below, dict(self._abort_rids)
                self._abort_all = False
                self._abort_rids.clear()
                finished: list[_Row] = []
                if abort_all or rids:
                    for queue in ("_waiting", "_held"):
                        kept = []
                        for row in getattr(self, queue):
                            if _aborted(row, below, rids):
                                row.finish = "abort"
                                finished.append(row)
                            else:
                                kept.append(row)
                        setattr(self, queue, collections.deque(kept) if queue == "_waiting" else kept)
                live = batch.n_live if batch is not None else 0
                free = self.max_batch_size - live
                # Each admission costs a prefill forward and a KV-cache merge, so slots are refilled
                # in groups (an eighth of the batch), or at once when everything waiting fits.
                if batch is not None and free < self._admit_min and len(self._waiting) > free:
                    free = 0
                admit = [self._waiting.popleft() for _ in range(min(free, len(self._waiting)))]
                self._running = (len(batch) if batch is not None else 0) + len(admit)
            if batch is not None and (abort_all or rids):
                with self._model_lock:
                    finished += batch.abort(lambda row: _aborted(row, below, rids))
            if not admit and (batch is None or batch.n_live == 0):
                batch = None
                with self._cond:  # idle before the answers go out: a caller told "aborted" sees load 0
                    self._running = 0
                    self._cond.notify_all()
                self._resolve(finished)
                continue
            self._resolve(finished)
            start = time.perf_counter()
            try:
                with self._model_lock:
                    batch = self._step(batch, admit)
            except BaseException as e:  # a failing model must not leave callers waiting forever
                rows = (batch.rows if batch is not None else []) + admit
                for row in rows:
                    if not row.future.done():
                        row.future.set_exception(e)
                batch = None
                with self._cond:
                    self._running = 0
                    self._cond.notify_all()
            self._stats["busy_seconds"] += time.perf_counter() - start

    @torch.inference_mode()
    def _step(self, batch, admit: list[_Row]):
        """Admit waiting rows (prefill), sample one token per live row, retire finished rows, then run
        one decode forward over the batch. Returns the batch, or None once no row is left."""
        if self._decoder is not None:
            return self._fast_step(batch, admit)
        return self._hf_step(batch, admit)

    def _fast_step(self, batch: SlotBatch | None, admit: list[_Row]) -> SlotBatch | None:
        if batch is None:
            # Weights change only while no batch runs: this is where the fused matrices are checked.
            self._decoder.ensure_current()
            dec = self._decoder
            if self._slots is None or self._slots.kv.device != dec.device or self._slots.kv.dtype != dec.dtype:
                self._slots = SlotBatch(
                    dec, dec.new_cache(), pad_token_id=self.pad_token_id, stop_string=self._stop_string,
                    original_logprob=self.return_original_logprob,
                )
            batch = self._slots
            batch.reset()
            batch.original_logprob = self.return_original_logprob
        if admit:
            batch.admit(admit)
        finished = batch.sample()
        if batch.n_live == 0:
            with self._cond:  # idle before the answers go out (as above)
                self._running = 0
                self._cond.notify_all()
            self._resolve(finished)
            return None
        self._resolve(finished)
        batch.decode()
        return batch

    def _hf_step(self, batch: _Batch | None, admit: list[_Row]) -> _Batch | None:
        """`_step` through Hugging Face's forward and `DynamicCache` (models the fast decoder does not cover)."""
        if admit:
            if batch is not None:
                dead = [j for j, alive in enumerate(batch.live) if not alive]
                if dead:  # admitted rows take the finished rows' slots
                    batch.select([j for j, alive in enumerate(batch.live) if alive])
            new = self._prefill(admit)
            if batch is None or not batch.rows:
                batch = new
            else:
                batch.merge(new)
        steps = torch.tensor([len(row.out) for row in batch.rows], dtype=torch.int64, device=batch.logits.device)
        tokens, logprobs = sample_next(batch.logits, batch.params, steps, self.return_original_logprob)
        tok_list, lp_list = tokens.tolist(), logprobs.float().tolist()
        finished = []
        for j, row in enumerate(batch.rows):
            if not batch.live[j]:
                continue
            row.out.append(tok_list[j])
            row.logprobs.append(lp_list[j])
            if self._finished(row):
                batch.live[j] = False
                finished.append(row)
        n_live = sum(batch.live)
        if n_live == 0:
            with self._cond:  # idle before the answers go out (as in _run)
                self._running = 0
                self._cond.notify_all()
            self._resolve(finished)
            return None
        self._resolve(finished)
        n_dead = len(batch) - n_live
        if n_dead >= _COMPACT_FRACTION * len(batch):
            batch.select([j for j, alive in enumerate(batch.live) if alive])
        last = torch.tensor([row.out[-1] if row.out else self.pad_token_id for row in batch.rows], dtype=torch.long)
        batch.mask = torch.cat([batch.mask, batch.mask.new_ones((len(batch), 1))], dim=1)
        batch.logits = self.model(
            input_ids=last[:, None].to(batch.mask.device),
            attention_mask=batch.mask if batch.padded else None,
            position_ids=batch.next_pos,
            **{self._cache_kw: batch.cache},
            use_cache=True,
        ).logits[:, -1].float()
        batch.next_pos = batch.next_pos + 1
        return batch

    def _prefill(self, rows: list[_Row]) -> _Batch:
        """Run the prompts of `rows` into a fresh KV cache; copies of one prompt share one prefill."""
        from transformers import DynamicCache

        dev = self.device
        distinct: dict[tuple[int, ...], int] = {}
        share = [distinct.setdefault(tuple(row.req.input_ids), len(distinct)) for row in rows]
        prompts = [list(p) for p in distinct]
        lens = [len(p) for p in prompts]
        width = max(lens)
        padded = any(k != width for k in lens)
        pad = self.pad_token_id
        # One tensor from padded lists: a torch.tensor per row costs more than the model at batch 256.
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
        ).logits[:, -1].float()
        if len(prompts) < len(rows):
            idx = torch.tensor(share, dtype=torch.long, device=dev)
            cache.batch_select_indices(idx)
            logits, mask, positions = logits[idx], mask[idx], positions[idx]
        params = BatchParams.build([row.req.sampling_params for row in rows], [row.key for row in rows], dev)
        return _Batch(list(rows), cache, mask, positions[:, -1:] + 1, logits, params, padded)

    def _resolve(self, rows: list[_Row]) -> None:
        if not rows:
            return
        for row, resp in zip(rows, self._responses(rows, self.weight_version)):
            self._stats["requests"] += 1
            self._stats["generated_tokens"] += len(row.out)
            if not row.future.done():
                row.future.set_result(resp)

    def _finished(self, row: _Row) -> bool:
        """Decide whether `row` is done after its latest token; record why."""
        sp = row.req.sampling_params
        tok = row.out[-1]
        if tok in row.stop_ids:
            row.finish, row.matched = "stop", tok
        elif sp.stop and (match := self._stop_string(sp, row.out)) is not None:
            row.finish, row.matched = "stop", match
        elif len(row.out) >= sp.max_new_tokens:
            row.finish = "length"
        else:
            return False
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
                output_ids=list(row.out),
                text=text,
                finish_type=row.finish or "abort",
                prompt_tokens=len(row.req.input_ids),
                weight_version=version,
                output_token_logprobs=list(row.logprobs) if row.req.return_logprob else None,
                matched=row.matched,
                rid=row.req.rid,
            )
            for row, text in zip(rows, texts)
        ]

    # ------------------------------------------------------------------ control

    def _idle(self) -> bool:
        return not self._waiting and self._running == 0

    def pause_generation(self) -> None:
        """SGLang's mode "abort": running and queued requests return now with finish_reason "abort";
        requests submitted from now on are held until `continue_generation()`."""
        with self._cond:
            self._paused = True
            self._abort_below = self._seq
            self._abort_all = True
            self._cond.notify_all()
            self._ensure_thread()
            if threading.current_thread() is not self._thread:  # (a hook on the scheduler thread must not wait on itself)
                self._cond.wait_for(self._idle, self.wait_timeout_s)

    def continue_generation(self) -> None:
        with self._cond:
            self._paused = False
            self._release_held()

    def _release_held(self) -> None:
        if not self._paused and not self._updating and self._held:
            self._waiting.extend(self._held)
            self._held.clear()
            self._ensure_thread()
        self._cond.notify_all()

    def begin_weight_update(self) -> None:
        with self._cond:
            if self._updating:
                raise RuntimeError("begin_weight_update() called twice without end_weight_update()")
            self._updating = True  # new requests are held from here on
            if not self._cond.wait_for(self._idle, self.wait_timeout_s):
                self._updating = False
                self._release_held()
                raise TimeoutError(
                    f"begin_weight_update() waited {self.wait_timeout_s:.0f} s for {self._running + len(self._waiting)} "
                    "in-flight request(s) to finish; call pause_generation() first to abort them"
                )

    def update_weights_from_tensors(
        self, named_tensors: list[tuple[str, torch.Tensor]], *, flush: bool = True
    ) -> None:
        if not self._updating:
            raise RuntimeError("update_weights_from_tensors() must run between begin_weight_update() and end")
        with self._model_lock, torch.no_grad():
            for name, tensor in named_tensors:
                if name in self._fused_names:
                    raise KeyError(f"{name!r} is transformers' in-memory (fused) name of MoE experts; send the "
                                   "checkpoint's names (mlp.experts.{e}.gate_proj.weight, ...), which SGLang loads")
                param = self._params.get(name)
                if param is None:  # a checkpoint-named MoE expert: its slice of the fused parameter
                    param = fused_slice(self._params, name)
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

    def parameter_specs(self) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
        return [(n, p.dtype, tuple(p.shape)) for n, p in self.model.named_parameters()]

    def end_weight_update(self, version: int) -> None:
        with self._cond:
            if not self._updating:
                raise RuntimeError("end_weight_update() called without begin_weight_update()")
            self.weight_version = int(version)
            self._updating = False
            self._release_held()

    def flush_cache(self) -> None:
        """No-op: KV entries live only while their request runs, and updates wait for an idle engine
        (the fast path keeps its cache buffer between batches, never its entries)."""

    def release_memory_occupation(self, tags: list[str] | None = None) -> None:
        """--offload-rollout: with the "weights" tag, weights to host memory (no-op on CPU, where they
        already are); KV entries live only while their request runs and there are no CUDA graphs."""
        if "weights" in memory_tags(tags) and self.device.type != "cpu":
            with self._model_lock:
                self._slots = None
                self.model.to("cpu")
                torch.cuda.empty_cache()

    def resume_memory_occupation(self, tags: list[str] | None = None) -> None:
        if "weights" in memory_tags(tags) and self.device.type != "cpu":
            with self._model_lock:
                self.model.to(self.device)

    def health(self) -> dict[str, Any]:
        s = self._stats
        return {
            "ok": self._thread is None or self._thread.is_alive(),
            "engine": "builtin",
            "model": str(self.hf_dir),
            "device": str(self.device),
            "dtype": str(self.dtype).removeprefix("torch."),
            "decode_path": self.decode_path,
            "weight_version": self.weight_version,
            "paused": self._paused,
            "updating": self._updating,
            "running": self._running,
            "waiting": len(self._waiting) + len(self._held),
            "requests": s["requests"],
            "generated_tokens": s["generated_tokens"],
            "tokens_per_s": s["generated_tokens"] / s["busy_seconds"] if s["busy_seconds"] else 0.0,
        }

    def named_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(Hugging Face checkpoint name, tensor) for every parameter, tied ones listed once; MoE experts
        that transformers fuses in memory are listed per expert, as trainers send them."""
        return checkpoint_tensors(self.model.named_parameters(), getattr(self.model.config, "model_type", None))

    def get_weights_checksum(self) -> str:
        return weights_checksum(self.named_parameters())


def _aborted(row: _Row, below: int, rids: dict[str, int]) -> bool:
    """Whether an abort submitted after this row reaches it: abort-all, or its rid prefix (SGLang matches by prefix)."""
    if row.seq < below:
        return True
    rid = row.req.rid
    return rid is not None and any(row.seq < bound and rid.startswith(prefix) for prefix, bound in rids.items())


# SGLang sampling keys the built-in engine does not implement, with the value that means "off";
# a request may carry them only at that value.
_UNSUPPORTED_DEFAULTS: dict[str, Any] = {
    "min_p": 0.0, "frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0,
    "min_new_tokens": 0, "n": 1, "json_schema": None, "regex": None, "ebnf": None, "structural_tag": None,
    "ignore_eos": False, "spaces_between_special_tokens": True, "no_stop_trim": False, "stream_interval": None,
    "logit_bias": None, "custom_params": None, "stop_regex": None,
}


def reject_unsupported_sampling(sp: SamplingParams) -> None:
    """Raise ValueError naming any SGLang sampling key this engine cannot honour at the value given."""
    bad = []
    for key, value in (sp.extra or {}).items():
        if key not in _UNSUPPORTED_DEFAULTS:
            bad.append(f"{key}={value!r} (not an SGLang sampling key)")
        elif value is not None and value != _UNSUPPORTED_DEFAULTS[key]:
            # no_stop_trim=True is what this engine does anyway: the matched stop stays in the text.
            if key == "no_stop_trim" and value is True:
                continue
            bad.append(f"{key}={value!r}")
    if bad:
        raise ValueError(
            f"the built-in engine cannot honour sampling_params {', '.join(bad)}; drop them or use --rollout-backend sglang"
        )
