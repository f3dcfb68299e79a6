"""The default generate function: one engine request per sample, its answer written into the sample.

    --custom-generate-function-path miles.rollout.generate_hub.single_turn.generate   (the default)

The prompt's token ids are the ones the dataset tokenized once (`sample.tokens` while the sample has
no response); a sample without them is tokenized here (no special tokens, as the dataset does). New
tokens are capped so that prompt + response stay within --rollout-max-context-len. The response's
ids, text, per-token log-probs, status (stop -> completed, length -> truncated, abort -> aborted) and
weight version are written into the sample, which is returned. No re-tokenisation: the tokens trained
are the engine's.

`request_for` and `fill_from_response` are the two halves, for generate functions that build on it.
"""

from __future__ import annotations

import dataclasses

from miles.rollout.engine.base import GenerateRequest, GenerateResponse
from miles.rollout.generate_hub.types import GenerateInput
from miles.sample import Sample, SampleStatus

_STATUS = {"stop": SampleStatus.COMPLETED, "length": SampleStatus.TRUNCATED}


def request_for(input: GenerateInput) -> GenerateRequest:
    """The request for `input.sample`'s prompt (its `tokens` are set to the prompt ids)."""
    s = input.sample
    if s.tokens and s.response_length == 0:
        prompt_ids = list(s.tokens)
    else:
        prompt_ids = input.tokenizer.encode(s.prompt, add_special_tokens=False)
        s.tokens = list(prompt_ids)
    params = input.sampling_params
    context = input.cfg.rollout.rollout_max_context_len
    if context is not None:
        params = dataclasses.replace(params, max_new_tokens=max(0, min(params.max_new_tokens, context - len(prompt_ids))))
    return GenerateRequest(input_ids=prompt_ids, sampling_params=params, return_logprob=True, rid=input.rid)


def fill_from_response(s: Sample, resp: GenerateResponse) -> Sample:
    """Append `resp` to `s` as its response (see the module docstring); returns `s`."""
    s.tokens = s.tokens + list(resp.output_ids)
    s.response_length = len(resp.output_ids)
    s.response = resp.text
    s.rollout_log_probs = [float(x) for x in (resp.output_token_logprobs or [])]
    s.status = _STATUS.get(resp.finish_type, SampleStatus.ABORTED)
    s.weight_version = resp.weight_version
    return s


async def generate(input: GenerateInput) -> Sample:
    """One request for the sample's prompt; the sample, filled in place."""
    return fill_from_response(input.sample, await input.engine.generate(request_for(input)))
