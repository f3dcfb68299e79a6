"""The megatron layout checks that need only the configuration (run by `resolve()` and by the trainer).

`check_layout` refuses parallel sizes that do not divide the training ranks or each other's needs;
`check_hardware` refuses TransformerEngine-only features without CUDA. Each raises one `UserError`
naming the option. Nothing here imports megatron or torch.
"""

from __future__ import annotations

import importlib.util

from miles.errors import UserError


def check_layout(cfg, world_size: int) -> None:
    """The checks that need only the config (run by `resolve()` too, before anything starts)."""
    t = cfg.train
    sizes = {"--tensor-model-parallel-size": t.tensor_model_parallel_size,
             "--pipeline-model-parallel-size": t.pipeline_model_parallel_size,
             "--context-parallel-size": t.context_parallel_size,
             "--expert-model-parallel-size": t.expert_model_parallel_size,
             "--expert-tensor-parallel-size": t.expert_tensor_parallel_size}
    for flag, value in sizes.items():
        if value < 1:
            raise UserError(f"{flag} must be at least 1.", option=flag)
    model_parallel = t.tensor_model_parallel_size * t.pipeline_model_parallel_size * t.context_parallel_size
    _divides_workers(model_parallel, world_size, "--tensor-model-parallel-size", "--pipeline-model-parallel-size", "--context-parallel-size")
    # megatron-core lays the expert layers out as expert-TP x EP x PP over the same ranks.
    expert_parallel = t.expert_tensor_parallel_size * t.expert_model_parallel_size * t.pipeline_model_parallel_size
    _divides_workers(expert_parallel, world_size, "--expert-tensor-parallel-size", "--expert-model-parallel-size",
                     "--pipeline-model-parallel-size", option="--expert-model-parallel-size")
    if t.sequence_parallel and t.tensor_model_parallel_size == 1:
        raise UserError("--sequence-parallel needs --tensor-model-parallel-size > 1; drop it or raise TP.",
                        option="--sequence-parallel")
    if t.recompute_granularity == "full" and (t.recompute_method is None or t.recompute_num_layers is None):
        raise UserError("--recompute-granularity full needs --recompute-method and --recompute-num-layers; add both.",
                        option="--recompute-granularity")
    if t.recompute_granularity != "full" and (t.recompute_method is not None or t.recompute_num_layers is not None):
        raise UserError("--recompute-method and --recompute-num-layers apply only with --recompute-granularity full.",
                        option="--recompute-method")
    dp = world_size // model_parallel
    if cfg.data.global_batch_size is not None and cfg.data.global_batch_size % dp:
        raise UserError(
            f"--global-batch-size ({cfg.data.global_batch_size}) must be divisible by the {dp} data-parallel ranks "
            f"({world_size} workers / TP x PP x CP {model_parallel}).", option="--global-batch-size")


def _divides_workers(product: int, world_size: int, *flags: str, option: str | None = None) -> None:
    if world_size % product:
        raise UserError(
            f"{' x '.join(flags)} = {product} does not divide the {world_size} training workers "
            "(--num-nodes x --num-gpus-per-node); change the sizes or the worker count.", option=option or flags[0])


def check_hardware(cfg, *, cuda: bool) -> None:
    """TransformerEngine-only features are refused on a machine without CUDA (passed through with it)."""
    t = cfg.train
    if t.sequence_parallel and t.transformer_impl == "local" and (not cuda or importlib.util.find_spec("apex") is None):
        # megatron-core 0.16.1's local layer spec normalises with Apex's fused norm when Apex is
        # installed (GPU only) and otherwise with a plain-torch norm that asserts sequence_parallel off.
        raise UserError(
            "--sequence-parallel needs megatron-core's TransformerEngine or Apex norms (its plain-torch norm refuses "
            "sequence parallelism): " + ("drop it on CPU." if not cuda else "add --transformer-impl transformer_engine or install Apex."),
            option="--sequence-parallel")
    if cuda:
        return
    if t.transformer_impl == "transformer_engine":
        raise UserError("--transformer-impl transformer_engine needs TransformerEngine on a GPU; use --transformer-impl local on CPU.",
                        option="--transformer-impl")
    if t.fp8_format is not None:
        raise UserError(f"--fp8-format {t.fp8_format} needs TransformerEngine on a GPU; drop it on CPU.", option="--fp8-format")
    if t.attention_backend in ("flash", "fused"):
        raise UserError(f"--attention-backend {t.attention_backend} needs TransformerEngine on a GPU; use local or unfused on CPU.",
                        option="--attention-backend")
    if t.context_parallel_size > 1:
        raise UserError("--context-parallel-size > 1 needs TransformerEngine attention on a GPU; use 1 on CPU.",
                        option="--context-parallel-size")


def check_moe_layout(cfg, *, num_experts: int, cuda: bool | None) -> None:
    """megatron-core 0.16.1 refuses to train MoE layers under TP without sequence parallelism (its MoE
    layer raises in the first training forward); sequence parallelism in turn needs TE/Apex norms, which
    a CPU has not (`check_hardware`). `cuda` None: not known yet (the message then names both fixes)."""
    t = cfg.train
    if t.train_backend != "megatron" or not num_experts or t.tensor_model_parallel_size == 1 or t.sequence_parallel:
        return
    tp = t.tensor_model_parallel_size
    fix = {False: "on a CPU, where sequence parallelism cannot run, use --tensor-model-parallel-size 1 and split the "
                  "experts with --expert-model-parallel-size",
           True: "add --sequence-parallel (with --transformer-impl transformer_engine or Apex)",
           None: "add --sequence-parallel on a GPU, or on a CPU use --tensor-model-parallel-size 1 and split the experts "
                 "with --expert-model-parallel-size"}[cuda]
    raise UserError(
        f"--tensor-model-parallel-size {tp} on a MoE model needs --sequence-parallel (megatron-core refuses to train "
        f"MoE layers under tensor parallelism without it): {fix}.", option="--tensor-model-parallel-size")
