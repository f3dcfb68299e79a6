"""The rollout engine interface: what the driver calls, whether the engine is built in or SGLang.

A rollout engine turns prompts (token ids) into responses (token ids + per-token log-probs) and takes
new weights from the trainer. Its request and response follow SGLang's `/generate` JSON, so the
SGLang client is a thin HTTP wrapper and the built-in torch engine (`miles.rollout.engine.builtin`)
is a drop-in for tests and CPUs:

    request  = {"input_ids": [...], "sampling_params": {"temperature": 1.0, "top_p": 1.0, "top_k": -1,
                "max_new_tokens": 8, "stop": ["\\n"], "stop_token_ids": [2], "skip_special_tokens": True,
                "seed": 0}, "return_logprob": True}
    response = {"output_ids": [...], "text": "...", "output_token_logprobs": [...],
                "meta_info": {"finish_reason": {"type": "stop", "matched": 2}, "prompt_tokens": 4,
                              "completion_tokens": 2, "weight_version": 3}}

`output_token_logprobs` are, like SGLang's default, `log p(token)` under the distribution it was
sampled from after temperature scaling and before top-k/top-p truncation, i.e.
`log_softmax(logits / T)[token]` (T = 1 for greedy). That is what the trainer recomputes when it
divides its logits by `--rollout-temperature`. (SGLang's `SGLANG_RETURN_ORIGINAL_LOGPROB=1`, and the
built-in engine's `return_original_logprob=True`, return `log_softmax(logits)` at T = 1 instead.) With
the default `--rollout-temperature 1.0` the two are the same number.

Weight sync, in the order the driver calls it:

    engine.pause_generation()                  # in-flight requests finish with finish_reason "abort"
    engine.begin_weight_update()
    for bucket in iter_weight_buckets(named_tensors, update_weight_buffer_size):
        engine.update_weights_from_tensors(bucket)   # Hugging Face parameter names
    engine.end_weight_update(version)          # sets weight_version; responses carry it
    engine.continue_generation()

This module holds only the types and helpers; it imports no torch at module import time.
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
from typing import TYPE_CHECKING, Any, ContextManager, Literal

# The weight-bucket helpers live below every layer (trainers use them too); re-exported here for engines.
from miles.utils.weights import iter_weight_buckets, tensor_nbytes, weights_checksum  # noqa: F401

if TYPE_CHECKING:
    from concurrent.futures import Future

    import torch

    from miles.config.rollout import RolloutConfig

FinishType = Literal["stop", "length", "abort"]


@dataclasses.dataclass
class SamplingParams:
    """SGLang's `sampling_params` (the subset Miles uses); names and defaults match SGLang's."""

    temperature: float = 1.0
    """0 means greedy (argmax)."""
    top_p: float = 1.0
    top_k: int = -1
    """-1 (or 0) means no top-k truncation."""
    max_new_tokens: int = 128
    stop: list[str] | None = None
    """Stop strings, matched on the decoded response text; the match is kept in the output."""
    stop_token_ids: list[int] | None = None
    """Token ids that finish a response in addition to the model's eos token(s)."""
    skip_special_tokens: bool = True
    """Drop special tokens (pad/eos/...) from `text`; `output_ids` always keeps every token."""
    seed: int | None = None
    """Per-request seed (SGLang's `sampling_seed`): same seed and prompt -> same sample, whatever the batch."""
    extra: dict[str, Any] | None = None
    """Any other SGLang sampling key, passed through to engines that understand it (the built-in
    engine rejects the ones it cannot honour; SGLang rejects keys it does not know)."""

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        if isinstance(self.stop, str):  # SGLang accepts a single string
            self.stop = [self.stop]

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "SamplingParams":
        """Build from SGLang's JSON dict; keys not named here go to `extra` (passed through, not dropped)."""
        d = {k: v for k, v in d.items() if v is not None or k in ("stop", "stop_token_ids", "seed")}
        if "sampling_seed" in d:  # SGLang's name for the per-request seed
            d["seed"] = d.pop("sampling_seed")
        names = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        extra = {k: d.pop(k) for k in sorted(set(d) - names)}
        return cls(**d, extra=extra or None)

    @classmethod
    def from_rollout_config(cls, rollout: "RolloutConfig", *, seed: int | None = None) -> "SamplingParams":
        """The training rollouts' sampling: `--rollout-temperature/-top-p/-top-k/-max-response-len/-stop...`."""
        return cls(
            temperature=rollout.rollout_temperature,
            top_p=rollout.rollout_top_p,
            top_k=rollout.rollout_top_k,
            max_new_tokens=rollout.rollout_max_response_len,
            stop=list(rollout.rollout_stop) if rollout.rollout_stop else None,
            stop_token_ids=list(rollout.rollout_stop_token_ids) if rollout.rollout_stop_token_ids else None,
            skip_special_tokens=rollout.rollout_skip_special_tokens,
            seed=seed,
        )

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        if d.pop("seed") is not None:
            d["sampling_seed"] = self.seed
        d.update(d.pop("extra") or {})
        return d


@dataclasses.dataclass
class GenerateRequest:
    """One `/generate` request: a prompt as token ids and how to sample its continuation."""

    input_ids: list[int]
    sampling_params: SamplingParams = dataclasses.field(default_factory=SamplingParams)
    return_logprob: bool = False
    rid: str | None = None
    """Optional request id, echoed in the response's meta_info."""
    logprob_start_len: int | None = None
    """With `return_logprob`: also score the prompt's own tokens from this position on (SGLang's
    `input_token_logprobs`; position 0 has no log-prob). On-policy distillation's teacher scores a
    sample's whole token sequence this way, with `max_new_tokens` 0."""

    def __post_init__(self) -> None:
        if isinstance(self.sampling_params, dict):
            self.sampling_params = SamplingParams.from_dict(self.sampling_params)
        if not self.input_ids:
            raise ValueError("a generate request needs at least one input token")

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "input_ids": list(self.input_ids),
            "sampling_params": self.sampling_params.to_dict(),
            "return_logprob": self.return_logprob,
        }
        if self.rid is not None:
            d["rid"] = self.rid
        if self.logprob_start_len is not None:
            d["logprob_start_len"] = self.logprob_start_len
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "GenerateRequest":
        return cls(
            input_ids=list(d["input_ids"]),
            sampling_params=SamplingParams.from_dict(d.get("sampling_params", {})),
            return_logprob=bool(d.get("return_logprob", False)),
            rid=d.get("rid"),
            logprob_start_len=d.get("logprob_start_len"),
        )


@dataclasses.dataclass
class GenerateResponse:
    """The answer to one `GenerateRequest`."""

    output_ids: list[int]
    text: str
    finish_type: FinishType
    prompt_tokens: int
    weight_version: int | None = None
    output_token_logprobs: list[float] | None = None
    """One float per output id when the request set `return_logprob` (see the module docstring)."""
    matched: int | str | None = None
    """The stop token id or stop string that finished the response (finish_type "stop")."""
    rid: str | None = None
    input_token_logprobs: list[float | None] | None = None
    """With `logprob_start_len`: one entry per prompt token from that position on, the log-prob of the
    token given the ones before it (None for position 0, which nothing predicts)."""
    input_token_ids: list[int] | None = None
    """The prompt tokens `input_token_logprobs` score (SGLang pairs each log-prob with its token id)."""

    @property
    def completion_tokens(self) -> int:
        return len(self.output_ids)

    @property
    def finish_reason(self) -> dict[str, Any]:
        d: dict[str, Any] = {"type": self.finish_type}
        if self.matched is not None:
            d["matched"] = self.matched
        elif self.finish_type == "length":
            d["length"] = len(self.output_ids)
        return d

    @property
    def meta_info(self) -> dict[str, Any]:
        return {
            "id": self.rid,
            "finish_reason": self.finish_reason,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "weight_version": self.weight_version,
        }

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {"output_ids": self.output_ids, "text": self.text, "meta_info": self.meta_info}
        if self.output_token_logprobs is not None:
            d["output_token_logprobs"] = self.output_token_logprobs
        if self.input_token_logprobs is not None:
            d["input_token_logprobs"], d["input_token_ids"] = self.input_token_logprobs, self.input_token_ids
        return d

    @classmethod
    def from_sglang_json(cls, d: dict[str, Any]) -> "GenerateResponse":
        """Parse a real SGLang `/generate` answer (its logprobs are `[logprob, token_id, text]` in meta_info)."""
        meta = d["meta_info"]
        reason = meta.get("finish_reason") or {"type": "abort"}
        logprobs = d.get("output_token_logprobs")
        if logprobs is None and meta.get("output_token_logprobs") is not None:
            logprobs = [float(item[0]) for item in meta["output_token_logprobs"]]
        inputs = d.get("input_token_logprobs")
        if inputs is None and meta.get("input_token_logprobs") is not None:
            inputs = [None if item[0] is None else float(item[0]) for item in meta["input_token_logprobs"]]
            input_ids = [int(item[1]) for item in meta["input_token_logprobs"]]
        else:
            input_ids = d.get("input_token_ids")
        output_ids = d.get("output_ids")
        if output_ids is None and meta.get("output_token_logprobs") is not None:
            output_ids = [int(item[1]) for item in meta["output_token_logprobs"]]
        version = meta.get("weight_version")
        if isinstance(version, str) and not version.lstrip("-").isdigit():
            version = None  # SGLang's initial version is the string "default"
        return cls(
            output_ids=list(output_ids or []),
            text=d.get("text", ""),
            finish_type=reason["type"],
            prompt_tokens=int(meta.get("prompt_tokens", 0)),
            weight_version=int(version) if version not in (None, "") else None,
            output_token_logprobs=logprobs,
            matched=reason.get("matched"),
            rid=meta.get("id"),
            input_token_logprobs=inputs,
            input_token_ids=input_ids,
        )


class RolloutEngine(abc.ABC):
    """What the rollout manager needs from an engine, in-process or a server (`http_client.HttpEngine`),
    or a fleet of servers behind a router (`fleet.EngineFleet`). Generation is per request and
    asynchronous: `submit` returns a `concurrent.futures.Future` that resolves when that request
    finishes; `abort_request` ends the chosen ones early (their futures resolve with finish "abort").

    Optional capabilities are declared here with the answer of an engine that lacks them (no
    tokenizer, nothing to batch, nothing to recover, nothing to stop), so callers use them without
    asking which engine they got: `tokenizer`, `submitting_together`, `recover`, `shutdown`."""

    tokenizer: Any = None
    """The engine's Hugging Face tokenizer when it holds one in this process (the built-in engine);
    None for servers, whose callers load their own from --hf-checkpoint."""

    def submitting_together(self) -> ContextManager[Any]:
        """`with engine.submitting_together(): submit(...) ...`: requests submitted inside reach the
        engine's scheduler as one batch rather than a few at a time as it wakes up between them.
        Engines without a scheduler in this process (servers behind a router) need nothing."""
        return contextlib.nullcontext()

    def recover(self) -> bool:
        """After a failed weight update: recover the engines (restart dead ones with fault tolerance,
        close the update session of the others) and return True when the update may run again.
        Raises `RunStopped` naming a dead engine that cannot come back. False: nothing to recover
        (an in-process engine fails with its caller)."""
        return False

    def shutdown(self) -> None:
        """Stop what the engine started (servers, router); nothing for an in-process engine."""

    @abc.abstractmethod
    def submit(self, request: GenerateRequest) -> "Future[GenerateResponse]":
        """Queue one request; the future resolves to its response as soon as it finishes."""

    def generate(self, requests: list[GenerateRequest]) -> list[GenerateResponse]:
        """Answer every request (same order): submit all, then wait for all."""
        return [f.result() for f in [self.submit(r) for r in requests]]

    @abc.abstractmethod
    def abort_request(self, rid: str = "", abort_all: bool = False) -> None:
        """Finish the requests whose rid starts with `rid` (or all) now, with finish_reason "abort"."""

    @abc.abstractmethod
    def begin_weight_update(self) -> None:
        """Start a weight update: waits for in-flight generation to stop; new requests wait until the end."""

    @abc.abstractmethod
    def update_weights_from_tensors(
        self, named_tensors: list[tuple[str, "torch.Tensor"]], *, flush: bool = True
    ) -> None:
        """Copy one bucket of (Hugging Face name, tensor) into the model; `flush` drops cached KV/prefixes."""

    @abc.abstractmethod
    def end_weight_update(self, version: int) -> None:
        """Finish the update; responses generated from now on carry `weight_version == version`."""

    @abc.abstractmethod
    def pause_generation(self) -> None:
        """Stop generating: in-flight requests return early with finish_reason "abort"; new ones wait."""

    @abc.abstractmethod
    def continue_generation(self) -> None:
        """Undo `pause_generation`."""

    @abc.abstractmethod
    def flush_cache(self) -> None:
        """Drop any cached KV / prefix state (stale after a weight update)."""

    @abc.abstractmethod
    def release_memory_occupation(self, tags: list[str] | None = None) -> None:
        """Free device memory while a colocated trainer runs: the `tags` of MEMORY_TAGS (None: all)."""

    @abc.abstractmethod
    def resume_memory_occupation(self, tags: list[str] | None = None) -> None:
        """Take the device memory of `tags` back (None: all); weights are pushed again before generating."""

    @abc.abstractmethod
    def health(self) -> dict[str, Any]:
        """A JSON-able status dict; at least {"ok": bool, "weight_version": ..., "paused": bool}."""

    @abc.abstractmethod
    def get_weights_checksum(self) -> str:
        """`weights_checksum` of the engine's parameters in HF naming (for `--check-weight-update-equal`)."""


# SGLang's memory tags (`sglang/srt/constants.py`): what `release/resume_memory_occupation` act on.
MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")


def memory_tags(tags: list[str] | None) -> list[str]:
    """The tags a release/resume acts on (None or empty: all), checked against MEMORY_TAGS."""
    if not tags:
        return list(MEMORY_TAGS)
    unknown = [t for t in tags if t not in MEMORY_TAGS]
    if unknown:
        raise ValueError(f"unknown memory tag {unknown[0]!r} (one of {', '.join(MEMORY_TAGS)})")
    return list(tags)
