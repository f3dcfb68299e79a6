"""Training options: which trainer runs and how its batches are cut."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from miles.config.fields import option
from miles.config.trainer_support import not_yet


@dataclass
class TrainConfig:
    train_backend: Literal["torch", "fsdp", "megatron"] = option(
        "torch",
        help="Trainer: torch (a Hugging Face model, CPU or GPU; DDP: every worker holds all weights), fsdp (the same "
        "model sharded over the workers with torch FSDP2: weights, gradients and optimizer state split) or megatron "
        "(megatron-core: TP/PP/CP/EP).",
    )
    micro_batch_size: int = option(1, help="Samples per forward/backward pass; gradients accumulate up to --global-batch-size.")
    bf16: bool = option(
        False,
        help="Train in bfloat16 with fp32 master weights, gradients reduced in fp32 and fp32 optimizer state; weights "
        "go to the engines in the engine's dtype." + not_yet("bf16"),
    )
    use_dynamic_batch_size: bool = option(
        False,
        help="Cut micro-batches by a token budget (--max-tokens-per-gpu) instead of by --micro-batch-size samples, "
        "balanced across the data-parallel ranks." + not_yet("use_dynamic_batch_size"),
    )
    max_tokens_per_gpu: int | None = option(
        None,
        help="Token budget of one micro-batch on one GPU with --use-dynamic-batch-size (after context-parallel "
        "splitting); the memory plan sizes activations by it.",
    )
    deterministic_mode: bool = option(
        False,
        help="Deterministic kernels and seeded RNG in the trainer, so identical runs (and resumed runs) give identical weights.",
        # What deterministic kernels need from the environment: cuBLAS refuses deterministic matmuls
        # without a fixed workspace, NCCL's tree/ring choice changes reduction order, and
        # TransformerEngine picks non-deterministic kernels unless told not to.
        run_env={"CUBLAS_WORKSPACE_CONFIG": ":4096:8", "NCCL_ALGO": "Ring", "NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0"},
    )
    train_memory_margin_bytes: int = option(
        1024**3,
        help="Device memory the trainer leaves free for the rollout engines when colocated.",
        unsupported="it only applies to GPU training, which this build does not run yet",
    )
    # megatron-core (--train-backend megatron); upstream Megatron's names. The data-parallel size is
    # the training worker count divided by TP x PP x CP.
    tensor_model_parallel_size: int = option(1, help="Megatron: tensor-parallel size (each layer's matrices split over this many ranks).")
    pipeline_model_parallel_size: int = option(1, help="Megatron: pipeline-parallel size (the layers split into this many consecutive stages).")
    context_parallel_size: int = option(
        1, help="Megatron: context-parallel size (each sequence split over this many ranks; needs TransformerEngine, i.e. a GPU)."
        + not_yet("context_parallel_size")
    )
    expert_model_parallel_size: int = option(
        1, help="Megatron: expert-parallel size (the experts of a MoE layer split over this many ranks)." + not_yet("expert_model_parallel_size")
    )
    expert_tensor_parallel_size: int = option(
        1, help="Megatron: tensor-parallel size inside each expert (1: every expert whole on its rank)." + not_yet("expert_tensor_parallel_size")
    )
    sequence_parallel: bool = option(
        False,
        help="Megatron: split norms and dropout along the sequence over the tensor-parallel ranks (needs TP > 1 and "
        "TransformerEngine or Apex norms, i.e. a GPU).",
    )
    recompute_granularity: Literal["full", "selective"] | None = option(
        None, help="Recompute activations in backward instead of storing them: full layers or (megatron only) only the "
        "attention core; unset = store all. On --train-backend torch/fsdp, full is Hugging Face gradient checkpointing "
        "of every decoder layer."
    )
    recompute_method: Literal["uniform", "block"] | None = option(
        None, help="Megatron, with --recompute-granularity full: recompute uniform groups of layers or the first N layers of each stage."
    )
    recompute_num_layers: int | None = option(
        None, help="Megatron, with --recompute-granularity full: layers per recompute group (uniform) or recomputed layers per stage (block)."
    )
    use_distributed_optimizer: bool = option(False, help="Megatron: shard the optimizer state over the data-parallel ranks (ZeRO-1).")
    transformer_impl: Literal["local", "transformer_engine"] = option(
        "local", help="Megatron layer implementation: local (plain PyTorch, any device) or transformer_engine (GPU only)."
        + not_yet("transformer_impl"),
    )
    fp8_format: Literal["e4m3", "hybrid"] | None = option(None, help="Megatron: train in FP8 with this format (needs TransformerEngine on a GPU); unset = off."
                                                    + not_yet("fp8_format"))
    attention_backend: Literal["auto", "local", "flash", "fused", "unfused"] = option(
        "auto", help="Megatron attention kernel; flash and fused need TransformerEngine on a GPU; local/unfused run anywhere."
        + not_yet("attention_backend"),
    )
