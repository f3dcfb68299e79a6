"""The torch critic: the policy's decoder with a scalar value head, and its per-response-token values.

PPO's critic (`--advantage-estimator ppo`) is the policy's architecture with the LM head replaced by
`Linear(hidden, 1)` (weight N(0, 0.02) drawn from its own generator seeded by `--seed`, so both
backends and every parallel layout start from the same head; bias 0, as upstream's megatron critic): the decoder is loaded
from `--critic-load` (default: the policy's `--hf-checkpoint`) as a bare `AutoModel`, so no LM head
is loaded or trained. The value of response token t is read at the position just before it, the
alignment of the log-probs (`miles.backends.torch.forward`), so V_t is the value of the state the
policy sampled token t in. No temperature applies to a value.

`ValueModel.forward` takes the same keyword arguments as `ResponseLogits.forward`
(`forward.layout_inputs`), so both layouts (packed, padded) and DDP/FSDP wrap it unchanged.

Use: `values = response_values(ValueModel.from_pretrained(hf_dir, device), batch)`  # [R] float32
"""

from __future__ import annotations

import torch

from miles.backends.base import PackedBatch
from miles.backends.torch.forward import choose_layout, layout_inputs

VALUE_HEAD_INIT_STD = 0.02


def init_value_head(head: torch.nn.Linear, seed: int) -> None:
    """Weight N(0, 0.02) from a generator of its own seeded with `seed` (--seed), bias 0: the same head
    on every rank, every parallel layout and both backends, whatever else drew from the global RNG."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        head.weight.copy_(torch.randn(head.weight.shape, generator=g) * VALUE_HEAD_INIT_STD)
        head.bias.zero_()


class _DropLoadReport:
    def filter(self, record) -> bool:
        return "LOAD REPORT" not in record.getMessage()


class ValueModel(torch.nn.Module):
    """`lm`: a HF decoder without LM head (its `.config` is the policy's); `value_head`: hidden -> 1."""

    def __init__(self, lm: torch.nn.Module, seed: int = 0):
        super().__init__()
        self.lm = lm
        self.value_head = torch.nn.Linear(lm.config.hidden_size, 1, bias=True, dtype=torch.float32)
        init_value_head(self.value_head, seed)

    @classmethod
    def from_pretrained(cls, hf_dir: str, device: str, seed: int = 0) -> "ValueModel":
        import logging

        from transformers import AutoModel

        # The policy's checkpoint holds an LM head the bare decoder does not load, by design; its
        # load report would call that UNEXPECTED on every start.
        # (A filter, not a raised level: transformers runs more checks when its logger's level is set.)
        log = logging.getLogger("transformers.modeling_utils")
        drop = _DropLoadReport()
        log.addFilter(drop)
        try:
            # fp32 and eager attention, as the policy trainer loads its model (same numbers everywhere).
            lm = AutoModel.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager")
        finally:
            log.removeFilter(drop)
        return cls(lm, seed).to(device)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        position_ids: torch.Tensor | None,
        rows: torch.Tensor,
        cols: torch.Tensor,
    ) -> torch.Tensor:
        hidden = self.lm(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False).last_hidden_state
        return self.value_head(hidden[rows, cols].float()).squeeze(-1)


def response_values(net: torch.nn.Module, batch: PackedBatch) -> torch.Tensor:
    """Values [R] of the batch's response tokens (float32); gradients flow unless the caller disables them.

    `net` is a `ValueModel` or a DDP/FSDP wrapper of one; the layout is chosen as for log-probs.
    """
    inner = getattr(net, "module", net)
    layout = choose_layout((batch.cu_seqlens[1:] - batch.cu_seqlens[:-1]).tolist(), inner.lm.config.hidden_size)
    return net(**layout_inputs(batch, layout))
