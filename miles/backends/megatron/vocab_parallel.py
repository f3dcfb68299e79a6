"""Log-probs and entropies from vocabulary-parallel logits: no TP rank holds the whole vocabulary.

Under tensor parallelism megatron-core's output layer is column-parallel: TP rank r computes the logits
of vocabulary columns `[r * V_local, (r + 1) * V_local)` only (`parallel_output=True`). Gathering them
would put a `[tokens, V]` tensor on every rank (151k columns for Qwen3), so the softmax is taken over
the TP group instead, on the `[R, V_local]` slice at the R scored positions:

- log Z = m + log(sum over ranks of sum_v exp(z_v - m)), with m the group's max (no gradient: log Z
  does not depend on the shift);
- log p(target) = z_target - log Z, where z_target comes from the one rank whose slice holds the
  target (the others contribute 0 to a group sum);
- entropy H = log Z - E[z], E[z] = (sum over ranks of sum_v e_v z_v) / (sum over ranks of sum_v e_v),
  e_v = exp(z_v - m).

Every rank then holds the same [R] values. Columns at or past the real vocabulary size (the padding
to a multiple of TP) are dropped from the slice before any of this.

The group sum's backward is the identity (`_SumOverGroup`): every TP rank computes the same loss from
the summed value, and each rank's slice must get the gradient of that one loss once, as megatron-core's
`reduce_from_tensor_model_parallel_region` does (a plain differentiable all-reduce would add the TP
copies of the gradient, multiplying it by the TP size). That is right only when every summed partial
depends on this rank's slice alone, which is why the entropy is written with two sums rather than
with p_v = exp(z_v - log Z).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class _SumOverGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:  # noqa: ARG004 - autograd's signature
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: ARG004
        return grad, None


def _sum_over_group(x: torch.Tensor, group) -> torch.Tensor:
    return _SumOverGroup.apply(x, group)


def vocab_parallel_log_probs(
    logits: torch.Tensor, targets: torch.Tensor, *, vocab_start: int, vocab_size: int, group, with_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs [R] of `targets` [R] (global token ids) and, with `with_entropy`, entropies [R], from
    this rank's logits [R, V_local] (float32, temperature already applied) for global columns
    `vocab_start ..`; `vocab_size`: the real vocabulary (columns past it are padding). Collective over
    `group` (the TP group): every rank gets the same values; differentiable."""
    valid = max(0, min(logits.shape[-1], vocab_size - vocab_start))
    z = logits[:, :valid]
    with torch.no_grad():
        m = z.amax(dim=-1) if valid else z.new_full(z.shape[:1], float("-inf"))
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
    e = torch.exp(z - m[:, None])
    sum_e = _sum_over_group(e.sum(dim=-1), group)
    log_z = m + torch.log(sum_e)
    local = targets - vocab_start
    here = (local >= 0) & (local < valid)
    if valid:
        picked = z.gather(-1, local.clamp(0, valid - 1).unsqueeze(-1)).squeeze(-1)
        z_target = torch.where(here, picked, torch.zeros_like(picked))
    else:
        z_target = z.new_zeros(z.shape[:1])
    log_probs = _sum_over_group(z_target, group) - log_z
    if not with_entropy:
        return log_probs, None
    # E[z] = sum(e z) / sum(e), both sums over the group: a local partial may depend on the slice only,
    # never on a group value like log Z (its backward would then miss the other ranks' share).
    return log_probs, log_z - _sum_over_group((e * z).sum(dim=-1), group) / sum_e
