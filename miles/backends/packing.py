"""`pack_samples(train_data, indices, device)`: per-sample rollout data -> one `PackedBatch`.

The rollout side hands the trainer a dict of per-sample lists (`tokens`, `response_lengths`,
`loss_masks`, optionally `rollout_log_probs`); this concatenates the chosen samples' tokens and
flattens their per-response-token fields, in the order of `indices`. Advantages, returns, old and
reference log-probs are filled in later by the trainer.

(Placeholder on the megatron branch with the agreed signature; the trainer-interface branch owns
the real module.)
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from miles.backends.base import PackedBatch


def pack_samples(train_data: dict[str, Any], indices: Sequence[int], device: str | torch.device) -> PackedBatch:
    tokens = [torch.as_tensor(train_data["tokens"][i], dtype=torch.int64) for i in indices]
    lengths = torch.tensor([len(t) for t in tokens], dtype=torch.int64)
    resp = torch.tensor([int(train_data["response_lengths"][i]) for i in indices], dtype=torch.int64)
    for i, n, r in zip(indices, lengths.tolist(), resp.tolist()):
        if not 0 <= r < n:
            raise ValueError(f"sample {i} has {n} tokens and response_length {r}; it needs 0 <= response_length < tokens")
    cu = torch.zeros(len(tokens) + 1, dtype=torch.int64)
    cu[1:] = torch.cumsum(lengths, 0)
    mask = torch.cat([torch.as_tensor(train_data["loss_masks"][i], dtype=torch.float32) for i in indices])
    rollout = train_data.get("rollout_log_probs")
    rollout_lp = (
        torch.cat([torch.as_tensor(rollout[i], dtype=torch.float32) for i in indices]).to(device)
        if rollout is not None else None
    )
    return PackedBatch(tokens=torch.cat(tokens).to(device), cu_seqlens=cu.to(device), response_lengths=resp.to(device),
                       loss_mask=mask.to(device), rollout_log_probs=rollout_lp)
