"""Forward passes that return per-token log-probs (and entropies) of each sample's response.

Alignment: a causal LM's logits at position t predict token t + 1. For a sample with L tokens whose
last R are the response, the response tokens sit at positions L-R .. L-1, so their log-probs come
from the logits at positions L-R-1 .. L-2. A sample therefore needs at least one prompt token.

Samples of a micro-batch are right-padded to the longest one; with a causal mask, the padding at the
end cannot change the logits of the real positions before it. Only the response slice of the logits
is turned into log-probs, so memory beyond the model's own logits is O(response tokens x vocab).

Temperature: the rollout engine samples from `softmax(logits / T)` with T = `--rollout-temperature`
and reports the log-prob of each token under that distribution (before top-k/top-p truncation), as
SGLang does. The trainer must score the same policy, so `response_log_probs(..., temperature=T)`
divides the logits by T (`scale_logits_by_temperature`) before the log-softmax and the entropy; T = 0
(greedy) scores at 1, which is what the engine reports for greedy rows. Without this, PPO's ratio,
TIS weights and `train/train_rollout_logprob_abs_diff` compare a T = 1 policy with T samples.

Use: `log_probs, entropies = response_log_probs(model, tokens, response_lengths, temperature=T)`; wrap
it in `torch.no_grad()` when no gradient is needed.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

EntropyFn = Callable[[torch.Tensor], torch.Tensor]


def pad_right(token_lists: Sequence[Sequence[int]], pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """`input_ids` [B, T] right-padded with `pad_id` and the matching 0/1 `attention_mask`."""
    width = max(len(t) for t in token_lists)
    ids = torch.full((len(token_lists), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(token_lists), width), dtype=torch.long)
    for i, tokens in enumerate(token_lists):
        ids[i, : len(tokens)] = torch.as_tensor(tokens, dtype=torch.long)
        mask[i, : len(tokens)] = 1
    return ids, mask


def scale_logits_by_temperature(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """`logits / temperature`, the logits of the distribution the rollout engine samples from.

    temperature 0 means greedy decoding, whose log-probs the engine reports at T = 1, so 0 and 1 both
    return `logits` unchanged. Negative temperatures are rejected (the config rejects them earlier).
    """
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if temperature in (0, 1):
        return logits
    return logits / temperature


def response_log_probs(
    model: torch.nn.Module,
    tokens: Sequence[Sequence[int]],
    response_lengths: Sequence[int],
    *,
    entropy_fn: EntropyFn | None = None,
    device: str | torch.device = "cpu",
    temperature: float = 1.0,
) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
    """One forward over the samples; per sample the log-probs [R] of its R response tokens (float32).

    The log-probs (and, with `entropy_fn` (logits [N, V] -> entropy [N]), the entropies) are those of
    `softmax(logits / temperature)` at each response position (see the module docstring). Gradients
    flow unless the caller disables them.
    """
    for t, r in zip(tokens, response_lengths, strict=True):
        if not 0 <= r < len(t):
            raise ValueError(
                f"a sample has {len(t)} tokens and response_length {r}; it needs 0 <= response_length < "
                "len(tokens) (at least one prompt token predicts the first response token)"
            )
    input_ids, attention_mask = pad_right(tokens)
    logits = model(
        input_ids=input_ids.to(device), attention_mask=attention_mask.to(device), use_cache=False
    ).logits
    # One gather of every response position of the batch: slicing per sample would make backward
    # allocate (and sum) a full-size logits gradient per sample.
    rows = torch.cat([torch.full((r,), i, dtype=torch.long) for i, r in enumerate(response_lengths)])
    cols = torch.cat([torch.arange(len(t) - r - 1, len(t) - 1) for t, r in zip(tokens, response_lengths)])
    step_logits = logits[rows.to(logits.device), cols.to(logits.device)].float()  # [sum R, V]
    step_logits = scale_logits_by_temperature(step_logits, temperature)
    targets = input_ids[rows, cols + 1].to(logits.device)
    # log_softmax(x)[y] = x[y] - logsumexp(x): avoids materialising the [sum R, V] log-softmax.
    flat = step_logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(step_logits, dim=-1)
    sizes = list(response_lengths)
    log_probs = list(flat.split(sizes))
    entropies = list(entropy_fn(step_logits).split(sizes)) if entropy_fn is not None else None
    return log_probs, entropies
