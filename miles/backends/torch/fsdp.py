"""FSDP2 for the torch backend (`--train-backend fsdp`): shard a Hugging Face causal LM with torch's
`fully_shard` over the data-parallel ranks (gloo on CPU, NCCL on GPU).

`shard_response_logits(net, device)` shards every decoder layer and then the `ResponseLogits`
wrapper itself (the root: embeddings, final norm, LM head). Each rank then keeps 1/N of every
parameter, gradient and AdamW moment (DTensors, `Shard(0)`); a layer's full weights exist only
while it runs (all-gathered before its forward and backward, resharded after). Gradients are
reduce-scattered as a **sum**, not FSDP's default mean, for the same reason the DDP path sums: the
trainer already divides each micro-batch's loss by the whole global batch, so the sum over ranks is
exactly the gradient one process would compute.

`full_tensor(t)` turns a sharded parameter into the full tensor (a collective: every rank calls it
for the same parameters in the same order); a plain tensor passes through.

A run with one worker still shards (over a one-rank group that `ensure_process_group` creates), so
it runs the same code, and writes the same checkpoints, as a run with many.

Use (inside `TorchBackend`, before the optimizer is built):

    ensure_process_group(device)
    shard_response_logits(net, device)
"""

from __future__ import annotations

import datetime
import socket

import torch
import torch.distributed as dist

PROCESS_GROUP_TIMEOUT_MIN = 10


def ensure_process_group(device: str) -> None:
    """A one-rank process group when this process has none (a single worker, an in-process trainer):
    `fully_shard` needs a device mesh, which needs a process group."""
    if dist.is_initialized():
        return
    with socket.socket() as s:  # a port free right now on this host; only this process connects
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group(
        "nccl" if device.startswith("cuda") else "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=0,
        world_size=1,
        timeout=datetime.timedelta(minutes=PROCESS_GROUP_TIMEOUT_MIN),
    )


def decoder_layers(lm: torch.nn.Module) -> list[torch.nn.Module]:
    """The transformer blocks of a HF causal LM (`model.layers` in every family miles builds)."""
    layers = getattr(lm.base_model, "layers", None)
    if layers is None:
        raise ValueError(f"{type(lm).__name__}: no decoder layers at .base_model.layers to shard")
    return list(layers)


def shard_response_logits(net: torch.nn.Module, device: str, *, bf16: bool = False) -> None:
    """Apply `fully_shard` to every decoder layer of `net.lm`, then to `net` (the root), in place.

    `bf16`: FSDP2's mixed precision (bf16 compute from the fp32 shards, gradients reduced in fp32);
    the sharded parameters, their gradients and the optimizer state stay fp32.

    The root must be the module whose forward the trainer calls (`ResponseLogits`, which calls the
    decoder and the LM head itself), so that FSDP's root hooks unshard the embeddings and the head.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh("cuda" if device.startswith("cuda") else "cpu", (dist.get_world_size(),))
    # The default policy casts nothing: the fp32 path stays what it was without a policy.
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else MixedPrecisionPolicy()
    for layer in decoder_layers(net.lm):
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(net, mesh=mesh, mp_policy=mp)
    for module in net.modules():
        if isinstance(module, FSDPModule):
            # Sum, not mean (see the module docstring); force_sum keeps it one plain SUM collective,
            # which gloo supports (a divide factor would otherwise become NCCL's PreMulSum).
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a (possibly sharded) parameter; a collective for a DTensor."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t
