"""The default generate function: one engine request per sample, its answer written into the sample.

    --custom-generate-function-path miles.rollout.generate_hub.single_turn.generate   (the default)

The prompt's token ids are the ones the dataset tokenized once (`sample.tokens` while the sample has
no response); a sample without them is tokenized here (no special tokens, as the dataset does). New
tokens are capped so that prompt + response stay within --rollout-max-context-len. The response's
ids, text, per-token log-probs, status (stop -> completed, length -> truncated, abort -> aborted) and
weight version are written into the sample, which is returned. No re-tokenisation: the tokens trained
are the engine's.

A sample that already has a response (--partial-rollout: aborted earlier, given back with its
tokens) is continued: the request sends all its tokens, its new-token budget is what
--rollout-max-response-len leaves, and the answer is appended to its tokens, log-probs and per-token
weight versions. With --mask-offpolicy-in-partial-rollout the tokens of older weights get loss mask 0.

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
    params = input.sampling_params
    if s.response_length > 0:  # a partial rollout's continuation: from every token so far
        prompt_ids = list(s.tokens)
        params = dataclasses.replace(params, max_new_tokens=max(0, params.max_new_tokens - s.response_length))
    elif s.tokens:
        prompt_ids = list(s.tokens)
    else:
        prompt_ids = input.tokenizer.encode(s.prompt, add_special_tokens=False)
        s.tokens = list(prompt_ids)
    context = input.cfg.rollout.rollout_max_context_len
    if context is not None:
        params = dataclasses.replace(params, max_new_tokens=max(0, min(params.max_new_tokens, context - len(prompt_ids))))
    return GenerateRequest(input_ids=prompt_ids, sampling_params=params, return_logprob=True, rid=input.rid)


def fill_from_response(s: Sample, resp: GenerateResponse) -> Sample:
    """Append `resp` to `s` as its response, after what a partial rollout generated earlier (see the
    module docstring); returns `s`."""
    new, earlier = len(resp.output_ids), s.response_length
    logprobs = [float(x) for x in (resp.output_token_logprobs or [])]
    s.tokens = s.tokens + list(resp.output_ids)
    s.response_length = earlier + new
    s.response = (s.response + resp.text) if earlier else resp.text
    s.rollout_log_probs = (s.rollout_log_probs or [])[:earlier] + logprobs if earlier else logprobs
    s.weight_versions = (s.weight_versions or [])[:earlier] + [resp.weight_version] * new if earlier else [resp.weight_version] * new
    s.status = _STATUS.get(resp.finish_type, SampleStatus.ABORTED)
    s.weight_version = resp.weight_version
    return s


async def generate(input: GenerateInput) -> Sample:
    """One request for the sample's prompt (or the rest of its partial response); the sample, filled in place."""
    s, earlier = input.sample, input.sample.response_length
    fill_from_response(s, await input.engine.generate(request_for(input)))
    if earlier and input.cfg.asynchrony.mask_offpolicy_in_partial_rollout and s.status != SampleStatus.ABORTED:
        # Only the tokens of the weights that finished the response are this step's policy.
        s.loss_mask = [int(v == s.weight_version) for v in s.weight_versions]
    return s
