"""The contracts of the generate seam: what a generate function and a rollout function receive and return.

    async def generate(input: GenerateInput) -> GenerateOutput | Sample | list[Sample]
    async def rollout(input: RolloutFnInput) -> RolloutFnOutput | list[list[Sample]]

Names follow upstream miles (`GenerateFnInput`/`GenerateFnOutput`, `RolloutFnTrainOutput`), so a
function written for it reads the same attributes; the engine client and `cfg` are this project's.
Imports neither torch nor Ray.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from miles.errors import UserError
from miles.rollout.engine.base import SamplingParams
from miles.sample import Sample

if TYPE_CHECKING:
    from miles.config.engine import EngineConfig
    from miles.rollout.data_source import RolloutDataSource
    from miles.rollout.generate_hub.engine_client import EngineClient


@dataclasses.dataclass(frozen=True)
class GenerateInput:
    """One sample to generate, and everything needed to do it.

    A generate function may change `sample` in place and return it (single-turn does), or return new
    `Sample`s; it must not block the event loop (await the engine, run blocking work in a thread)."""

    sample: Sample
    """The sample to fill: `prompt`, and in `tokens` its prompt ids (tokenized once by the dataset)
    while `response_length` is 0. Numbering (`index`, `group_index`), `label` and `metadata` are set."""
    sampling_params: SamplingParams
    """This sample's own copy (change it freely): the rollout's (or eval's) sampling settings with
    `seed` already set for this sample (from --rollout-seed, the rollout id and `sample.index`), so a
    rerun regenerates the same response. `max_new_tokens` is --rollout-max-response-len; capping it to
    --rollout-max-context-len is the generate function's job (`single_turn.request_for` does it)."""
    engine: "EngineClient"
    """`await engine.generate(GenerateRequest)` -> `GenerateResponse`: the run's engines (in-process
    or behind the router), the same API either way."""
    cfg: "EngineConfig"
    """The run's resolved configuration (`cfg.rollout.rollout_max_context_len`, `cfg.reward`, ...)."""
    tokenizer: Any
    """The Hugging Face tokenizer of --hf-checkpoint (the engine's own when it has one)."""
    rollout_id: int
    evaluation: bool = False
    """True when the sample is one of an eval dataset's (eval sampling settings)."""
    rid: str | None = None
    """Request-id prefix of this sample: give it (or it plus a suffix, one per engine call) as
    `GenerateRequest.rid` so that the rollout can abort the sample's requests when it has enough
    groups. None in eval (nothing is aborted there)."""

    @property
    def args(self) -> "EngineConfig":
        """Upstream's name for the configuration (`input.args`), so functions written for it run."""
        return self.cfg


@dataclasses.dataclass
class GenerateOutput:
    """What a generate function returns: the generated sample, or several (e.g. one per turn of a
    trajectory). Each is scored (unless it already has a `reward`) and trained on; samples without
    `index`/`group_index` take the input sample's."""

    samples: Sample | list[Sample]


@dataclasses.dataclass(frozen=True)
class RolloutFnInput:
    """One training rollout to produce (`--rollout-function-path`)."""

    rollout_id: int
    data_source: "RolloutDataSource"
    """`get_samples(num_prompts, n_samples_per_prompt)` -> prompt groups (numbered, prompt ids set);
    `add_samples(groups)` gives prompts back, first in line for the next draw (fresh: no response)."""
    engine: "EngineClient"
    cfg: "EngineConfig"
    tokenizer: Any
    sampling_params: SamplingParams
    """The training rollouts' sampling settings, without a per-sample seed."""
    generate: Callable[..., Awaitable[list[Sample]]]
    """`await generate(sample, rid=None)` -> the samples the run's generate function
    (--custom-generate-function-path, single-turn by default) makes of `sample`, with the same
    per-sample seed the built-in rollout would use."""

    @property
    def args(self) -> "EngineConfig":
        return self.cfg


@dataclasses.dataclass
class RolloutFnOutput:
    """What a rollout function returns: prompt groups of samples, and metrics to log with the rollout's."""

    samples: list[list[Sample]]
    """The rollout's groups; all together exactly --rollout-batch-size x --n-samples-per-prompt
    samples (what the optimizer steps take). Samples without a `reward` are scored by the run's reward
    (--rm-type / --custom-rm-path), a group at a time."""
    metrics: dict[str, float] | None = None


def as_samples(out: Any, source: Sample, *, flag: str) -> list[Sample]:
    """The samples a generate function returned for `source` (numbered like it when they are not)."""
    if isinstance(out, GenerateOutput):
        out = out.samples
    if out is source:  # the common case, changed in place: nothing to check or number
        return [source]
    samples = [out] if isinstance(out, Sample) else out
    if not isinstance(samples, (list, tuple)) or not samples or not all(isinstance(s, Sample) for s in samples):
        got = "no samples" if isinstance(samples, (list, tuple)) and not samples else f"{type(out).__name__}"
        raise UserError(
            f"{flag} returned {got} for sample {source.index}; return the Sample, a non-empty list of Samples "
            "or a GenerateOutput.",
            option=flag,
        )
    for s in samples:
        if s.group_index is None:
            s.group_index = source.group_index
        if s.index is None:
            s.index = source.index
    return list(samples)


def as_groups(out: Any, *, flag: str) -> tuple[list[list[Sample]], dict[str, float]]:
    """The groups and metrics a rollout function returned, checked."""
    metrics: dict[str, float] = {}
    if isinstance(out, RolloutFnOutput):
        metrics = dict(out.metrics or {})
        out = out.samples
    ok = isinstance(out, (list, tuple)) and out and all(
        isinstance(g, (list, tuple)) and g and all(isinstance(s, Sample) for s in g) for g in out
    )
    if not ok:
        raise UserError(
            f"{flag} returned {type(out).__name__}; return a RolloutFnOutput or a non-empty list of non-empty "
            "lists of Samples (the prompt groups).",
            option=flag,
        )
    return [list(g) for g in out], metrics
