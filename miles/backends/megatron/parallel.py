"""Check the megatron options against the machine and the model, and set up megatron's process groups.

`check_options(cfg, world_size, shape, cuda=...)` raises one `UserError` (exit 2, one sentence naming
the option) for a layout that cannot run: sizes that do not divide the worker count or the model,
sequence parallelism without TP or without TE/Apex norms, and the TransformerEngine-only features on a
machine without CUDA.
`init_parallel(opts)` initialises `megatron.core.parallel_state` over the already-initialised
torch.distributed world (creating a one-rank gloo group when the caller runs a single process).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from miles.ckpt.convert.families import ModelShape
from miles.config.megatron_checks import check_hardware, check_layout  # noqa: F401  (the config-only checks)
from miles.errors import UserError


@dataclass(frozen=True)
class ParallelOptions:
    """The megatron options a model is built with (see miles/config/train.py for their help)."""

    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    context_parallel_size: int = 1
    expert_model_parallel_size: int = 1
    expert_tensor_parallel_size: int = 1
    sequence_parallel: bool = False
    recompute_granularity: str | None = None
    recompute_method: str | None = None
    recompute_num_layers: int | None = None
    transformer_impl: str = "local"
    fp8_format: str | None = None
    attention_backend: str = "auto"
    max_sequence_length: int = 4096
    bf16: bool = False


def options_from_config(cfg) -> ParallelOptions:
    t = cfg.train
    return ParallelOptions(
        tensor_model_parallel_size=t.tensor_model_parallel_size,
        pipeline_model_parallel_size=t.pipeline_model_parallel_size,
        context_parallel_size=t.context_parallel_size,
        expert_model_parallel_size=t.expert_model_parallel_size,
        expert_tensor_parallel_size=t.expert_tensor_parallel_size,
        sequence_parallel=t.sequence_parallel,
        recompute_granularity=t.recompute_granularity,
        recompute_method=t.recompute_method,
        recompute_num_layers=t.recompute_num_layers,
        transformer_impl=t.transformer_impl,
        fp8_format=t.fp8_format,
        attention_backend=t.attention_backend,
        bf16=t.bf16,
    )


def check_model(shape: ModelShape, opts: ParallelOptions) -> None:
    tp, pp, ep = opts.tensor_model_parallel_size, opts.pipeline_model_parallel_size, opts.expert_model_parallel_size
    problems = []
    for name, value in (("num_attention_heads", shape.num_attention_heads), ("num_query_groups", shape.num_query_groups),
                        ("ffn_hidden_size", shape.ffn_hidden_size), ("moe_ffn_hidden_size", shape.moe_ffn_hidden_size)):
        if value and value % tp:
            problems.append(f"{name}={value} is not divisible by --tensor-model-parallel-size {tp}")
    if shape.num_layers % pp:
        problems.append(f"num_layers={shape.num_layers} is not divisible by --pipeline-model-parallel-size {pp}")
    if ep > 1 and (not shape.is_moe or shape.num_experts % ep):
        problems.append(f"--expert-model-parallel-size {ep} needs a MoE model whose expert count divides by it "
                        f"(this model has {shape.num_experts})")
    if problems:
        raise UserError("The model cannot be split this way: " + "; ".join(problems) + ".", option="--tensor-model-parallel-size")


def init_parallel(opts: ParallelOptions, *, rank: int, world_size: int, device: str, seed: int = 0) -> None:
    import datetime

    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    if not dist.is_initialized():
        if world_size != 1:
            raise RuntimeError(f"world_size={world_size} needs torch.distributed initialised by the caller")
        from miles.utils.net import free_port

        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
        dist.init_process_group("nccl" if device == "cuda" else "gloo", rank=0, world_size=1,
                                timeout=datetime.timedelta(minutes=10))
    if device == "cuda":
        from miles.backends.collectives import select_cuda_device

        select_cuda_device(rank)
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=opts.tensor_model_parallel_size,
        pipeline_model_parallel_size=opts.pipeline_model_parallel_size,
        context_parallel_size=opts.context_parallel_size,
        expert_model_parallel_size=opts.expert_model_parallel_size,
        # Passed even at 1: megatron-core's own default is the attention TP size.
        expert_tensor_parallel_size=opts.expert_tensor_parallel_size,
    )
    if device == "cuda":
        # megatron-core forks the "model-parallel-rng" CUDA generator around every attention/embedding
        # dropout (entered on each forward even at dropout 0): it must be seeded per TP rank. (On CPU
        # miles.ckpt.megatron_compat makes that fork a no-op instead.)
        from megatron.core import tensor_parallel

        tensor_parallel.model_parallel_cuda_manual_seed(seed)
