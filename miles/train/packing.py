"""Build `PackedBatch`es from the rollout's per-sample train data.

The rollout side hands the trainer a dict of per-sample lists (`tokens`, `response_lengths`,
`rewards`, `loss_masks`, optional `rollout_log_probs` and `teacher_log_probs`; see miles/rollout/train_data.py). The RL step
picks the samples of one micro-batch by index and packs them: tokens concatenated with cumulative
sequence lengths, response-token fields concatenated in the same sample order. Per-token fields that
the step computes later (advantages, returns, old/ref log-probs) are left None.

Use: `batch = pack_samples(train_data, [0, 3, 5], "cpu")`.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import torch

from miles.backends.base import PackedBatch


def pack_samples(train_data: dict[str, Any], indices: Sequence[int], device: str | torch.device) -> PackedBatch:
    """Pack the samples `indices` of `train_data` (in that order) into one `PackedBatch` on `device`.

    Every sample needs at least one prompt token (the logits before the first response token predict
    it), a loss mask as long as its response, and rollout log-probs (when present) as long too.
    """
    indices = list(indices)
    tokens = [train_data["tokens"][i] for i in indices]
    response_lengths = [int(train_data["response_lengths"][i]) for i in indices]
    masks = [train_data["loss_masks"][i] for i in indices]
    rollout = train_data.get("rollout_log_probs")
    teacher = train_data.get("teacher_log_probs")
    for i, t, r, m in zip(indices, tokens, response_lengths, masks):
        if not 0 <= r < len(t):
            raise ValueError(
                f"sample {i} has {len(t)} tokens and response_length {r}; it needs 0 <= response_length < "
                "len(tokens) (at least one prompt token predicts the first response token)"
            )
        if len(m) != r:
            raise ValueError(f"sample {i} has a loss mask of {len(m)} entries for {r} response tokens")
        if rollout is not None and len(rollout[i]) != r:
            raise ValueError(f"sample {i} has {len(rollout[i])} rollout log-probs for {r} response tokens")
        if teacher is not None and len(teacher[i]) != r:
            raise ValueError(f"sample {i} has {len(teacher[i])} teacher log-probs for {r} response tokens")

    def per_token(values: list[list[float]] | None) -> torch.Tensor | None:
        if values is None:
            return None
        return torch.tensor(list(itertools.chain.from_iterable(values[i] for i in indices)), dtype=torch.float32, device=device)

    lengths = torch.tensor([len(t) for t in tokens], dtype=torch.int64)
    cu = torch.zeros(len(indices) + 1, dtype=torch.int64)
    torch.cumsum(lengths, 0, out=cu[1:])
    return PackedBatch(
        tokens=torch.tensor(list(itertools.chain.from_iterable(tokens)), dtype=torch.int64, device=device),
        cu_seqlens=cu.to(device),
        response_lengths=torch.tensor(response_lengths, dtype=torch.int64, device=device),
        loss_mask=torch.tensor(list(itertools.chain.from_iterable(masks)), dtype=torch.float32, device=device),
        rollout_log_probs=per_token(rollout),
        teacher_log_probs=per_token(teacher),
    )
