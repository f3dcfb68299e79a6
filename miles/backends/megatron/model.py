"""Build a megatron-core `GPTModel` (this rank's TP/PP/EP piece) from a Hugging Face config, load its
weights from an HF directory or a `torch_dist` checkpoint, and gather them back as full HF tensors.

Names go through convert's rule tables (`miles.ckpt.convert.mapping`): a rule ties one megatron-core
local-spec tensor to the HF tensors it is made of, for every supported family (Qwen2, Qwen3, Llama,
Qwen3-MoE). What this module adds is where each piece lives on a parallel model:

- PP: a stage holds a contiguous range of layers; `decoder.layers.{i}` is local, its global index is
  `layer_number - 1`. The embedding is on the first stage, final norm and output layer on the last.
- TP: a `tensor_model_parallel` parameter is cut along its `partition_dim` into equal contiguous
  pieces, except SwiGLU's `linear_fc1` (`[gate; up]`), where each rank holds `[gate_r; up_r]`.
  Vocabulary-parallel tensors are padded to a multiple of the TP size (the tiny model has 19 tokens);
  the padding rows are zero, never reach a log-prob and are stripped on the way out.
- EP: rank r holds experts `[r * E / ep, (r + 1) * E / ep)` as `local_experts.0..`.

Use: `model = build_model(shape, options)`; `load_weights(model, source_dir, shape)`;
`for name, tensor in iter_full_megatron_tensors(model, shape)` (collective).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Iterator

import torch
import torch.distributed as dist

from miles.backends.collectives import on_group_device
from miles.backends.megatron.parallel import ParallelOptions
from miles.ckpt.convert.families import ModelShape
from miles.ckpt.convert.layout import megatron_shapes
from miles.ckpt.convert.mapping import Rule, hf_to_megatron, rules_for
from miles.errors import UserError

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"^(.*mlp\.experts\.local_experts\.)(\d+)(\..+)$")
# TransformerEngine's fused norm parameter -> the local spec's name (which the rule tables use).
_TE_NORMS = {"self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
             "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight"}
VOCAB_TENSORS = ("embedding.word_embeddings.weight", "output_layer.weight")


def padded_vocab_size(vocab: int, tp: int) -> int:
    return -(-vocab // tp) * tp


def param_dtype(opts: ParallelOptions) -> torch.dtype:
    """The dtype of the model's parameters (the optimizer's fp32 main copy aside)."""
    return torch.bfloat16 if opts.bf16 else torch.float32


def transformer_config(shape: ModelShape, opts: ParallelOptions):
    import torch.nn.functional as F
    from megatron.core.transformer import TransformerConfig

    moe = {}
    if shape.is_moe:
        moe = dict(num_moe_experts=shape.num_experts, moe_ffn_hidden_size=shape.moe_ffn_hidden_size,
                   moe_router_topk=shape.moe_router_topk,
                   moe_router_pre_softmax=not shape.moe_norm_topk_prob, moe_grouped_gemm=False,
                   moe_shared_expert_intermediate_size=shape.shared_expert_ffn_hidden_size or None,
                   moe_shared_expert_gate=shape.shared_expert_gate)
    recompute = {}
    if opts.recompute_granularity:
        recompute = dict(recompute_granularity=opts.recompute_granularity, recompute_method=opts.recompute_method,
                         recompute_num_layers=opts.recompute_num_layers)
    extra = {}
    if opts.fp8_format is not None:
        extra["fp8"] = opts.fp8_format
    if opts.attention_backend != "auto":
        from megatron.core.transformer.enums import AttnBackend

        extra["attention_backend"] = AttnBackend[opts.attention_backend]
    return TransformerConfig(
        num_layers=shape.num_layers, hidden_size=shape.hidden_size, num_attention_heads=shape.num_attention_heads,
        num_query_groups=shape.num_query_groups, kv_channels=shape.head_dim, ffn_hidden_size=shape.ffn_hidden_size,
        normalization="RMSNorm", layernorm_epsilon=shape.norm_epsilon, gated_linear_unit=True,
        activation_func=F.silu, add_bias_linear=False, add_qkv_bias=shape.qkv_bias, qk_layernorm=shape.qk_layernorm,
        # The fused kernels are CUDA-only; the unfused paths compute the same thing.
        bias_activation_fusion=False, masked_softmax_fusion=False, persist_layer_norm=False,
        bias_dropout_fusion=False, apply_rope_fusion=False, gradient_accumulation_fusion=False,
        use_cpu_initialization=True, attention_dropout=0.0, hidden_dropout=0.0,
        # --bf16: megatron-core's mixed precision; the optimizer keeps fp32 main params (trainer.py).
        bf16=opts.bf16, params_dtype=param_dtype(opts), pipeline_dtype=param_dtype(opts),
        tensor_model_parallel_size=opts.tensor_model_parallel_size,
        pipeline_model_parallel_size=opts.pipeline_model_parallel_size,
        context_parallel_size=opts.context_parallel_size,
        expert_model_parallel_size=opts.expert_model_parallel_size,
        expert_tensor_parallel_size=opts.expert_tensor_parallel_size,
        sequence_parallel=opts.sequence_parallel,
        # Packed micro-batches have different lengths: pipeline stages exchange shapes first.
        variable_seq_lengths=opts.pipeline_model_parallel_size > 1,
        # The all-gather dispatcher gathers every EP rank's tokens into one tensor, so it needs the same
        # token count on each, which packed micro-batches of different data-parallel shards do not have
        # (gloo aborts on the size mismatch); all-to-all sends per-expert counts first. megatron-core
        # also refuses all-gather with variable sequence lengths (PP), even for dense models.
        moe_token_dispatcher_type=("alltoall" if opts.pipeline_model_parallel_size > 1 or opts.expert_model_parallel_size > 1
                                   else "allgather"),
        **moe, **recompute, **extra,
    )


def build_model(shape: ModelShape, opts: ParallelOptions):
    """This rank's GPTModel piece (parallel state must be initialised), local layer spec; fp32, or
    with --bf16 bf16 parameters inside megatron-core's `Float16Module` (which hands the last stage's
    logits back in fp32)."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    config = transformer_config(shape, opts)
    if opts.transformer_impl == "transformer_engine":
        # GPU only (check_hardware refuses it elsewhere). TE fuses the two pre-norms into the next
        # linear layer; `global_name` maps those names back to the local spec's.
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        spec = get_gpt_layer_with_transformer_engine_spec(num_experts=shape.num_experts or None,
                                                          moe_grouped_gemm=False, qk_layernorm=shape.qk_layernorm)
    else:
        spec = get_gpt_layer_local_spec(num_experts=shape.num_experts or None, moe_grouped_gemm=False,
                                        qk_layernorm=shape.qk_layernorm, normalization="RMSNorm")
    model = GPTModel(
        config, spec, vocab_size=padded_vocab_size(shape.vocab_size, opts.tensor_model_parallel_size),
        max_sequence_length=opts.max_sequence_length, pre_process=ps.is_pipeline_first_stage(),
        post_process=ps.is_pipeline_last_stage(), position_embedding_type="rope",
        rotary_base=int(shape.rotary_base), share_embeddings_and_output_weights=shape.tie_word_embeddings,
        # Under TP each rank keeps the logits of its vocabulary slice; log-probs and entropies are taken
        # over the TP group (vocab_parallel.py), never on a full-vocabulary tensor.
        parallel_output=True,
    )
    if opts.bf16:
        from megatron.core.transformer.module import Float16Module

        return Float16Module(config, model)
    return model


class ValueHead(torch.nn.Linear):
    """PPO critic's head in place of the last stage's `output_layer`: hidden -> 1, fp32, initialised like
    the torch critic's (`init_value_head`: the same head on every rank and layout). It takes the output layer's call (`weight=`, `runtime_gather_output=` ignored)
    and returns (values [s, b, 1], None). Replicated over TP ranks: its input (sequence parallel off) is
    the full hidden state on each, so every TP rank computes the same values and gradients."""

    def __init__(self, hidden_size: int, seed: int):
        from miles.backends.torch.value_model import init_value_head

        super().__init__(hidden_size, 1, bias=True, dtype=torch.float32)
        init_value_head(self, seed)

    def forward(self, hidden_states, weight=None, runtime_gather_output=None):  # noqa: ARG002 - output layer's signature
        return super().forward(hidden_states.float()), None


def attach_value_head(model, shape: ModelShape, seed: int) -> None:
    """Turn a loaded GPTModel piece into a critic's: the last stage's LM head becomes a `ValueHead`.
    Untied from the embedding (a critic never ties them), so no embedding gradient is all-reduced
    with it and its checkpoint keys are its own."""
    model = _unwrap(model)  # the GPTModel inside --bf16's Float16Module
    model.share_embeddings_and_output_weights = False
    if model.post_process:
        # In the model's dtype: under --bf16 the head's input is bf16 and its weights get fp32 main copies.
        model.output_layer = ValueHead(shape.hidden_size, seed).to(next(model.parameters()).dtype)


# --------------------------------------------------------------------------------------------------
# Local parameter  <->  global megatron name


def global_name(model, local: str) -> str:
    """`decoder.layers.{local}.…` -> `decoder.layers.{global}.…`, local expert -> global expert."""
    m = _LAYER.match(local)
    if m:
        layer = model.decoder.layers[int(m[1])].layer_number - 1
        local = f"decoder.layers.{layer}.{_TE_NORMS.get(m[2], m[2])}"
    e = _EXPERT.match(local)
    if e:
        from megatron.core import parallel_state as ps

        ep, ep_rank = ps.get_expert_model_parallel_world_size(), ps.get_expert_model_parallel_rank()
        num_local = _num_experts(model) // ep
        local = f"{e[1]}{ep_rank * num_local + int(e[2])}{e[3]}"
    return local


def _num_experts(model) -> int:
    return model.config.num_moe_experts or 0


def _unwrap(model):
    """The GPTModel inside megatron's DDP and/or Float16Module wrappers."""
    while hasattr(model, "module") and not hasattr(model, "decoder"):
        model = model.module
    return model


def named_local_params(model) -> Iterator[tuple[str, str, torch.Tensor]]:
    """(global megatron name, local name, parameter) for every parameter of this rank's piece."""
    inner = _unwrap(model)
    for local, p in inner.named_parameters():
        yield global_name(inner, local), local, p


def _tp_group_for(name: str):
    from megatron.core import parallel_state as ps

    if ".experts." in name and ".shared_experts." not in name:
        return ps.get_expert_tensor_parallel_group(), ps.get_expert_tensor_parallel_world_size(), ps.get_expert_tensor_parallel_rank()
    return ps.get_tensor_model_parallel_group(), ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()


def _is_swiglu_fc1(name: str) -> bool:
    return name.endswith("linear_fc1.weight")


def shard_for_rank(name: str, full: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """The piece of the full (TP=1, unpadded) megatron tensor `full` that `param` holds on this rank."""
    if name in VOCAB_TENSORS and full.shape[0] != _global_rows(param, name):
        pad = torch.zeros(_global_rows(param, name) - full.shape[0], *full.shape[1:], dtype=full.dtype)
        full = torch.cat([full, pad])
    if not getattr(param, "tensor_model_parallel", False):
        return full
    _, size, rank = _tp_group_for(name)
    dim = param.partition_dim
    if _is_swiglu_fc1(name):
        gate, up = full.chunk(2, dim=0)
        return torch.cat([gate.chunk(size, dim=0)[rank], up.chunk(size, dim=0)[rank]], dim=0)
    return full.chunk(size, dim=dim)[rank]


def _global_rows(param: torch.Tensor, name: str) -> int:
    _, size, _ = _tp_group_for(name)
    return param.shape[0] * (size if getattr(param, "tensor_model_parallel", False) else 1)


def gather_full(name: str, param: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Collective over this parameter's TP group: the full (TP=1) tensor, vocabulary padding stripped."""
    local = param.detach()
    if getattr(param, "tensor_model_parallel", False):
        group, size, _ = _tp_group_for(name)
        if size > 1:
            local = on_group_device(local, group)  # NCCL gathers CUDA tensors only
            parts = [torch.empty_like(local) for _ in range(size)]
            dist.all_gather(parts, local.contiguous(), group=group)
            if _is_swiglu_fc1(name):
                halves = [p.chunk(2, dim=0) for p in parts]
                local = torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
            else:
                local = torch.cat(parts, dim=param.partition_dim)
    if name in VOCAB_TENSORS:
        local = local[:vocab_size]
    return local


# --------------------------------------------------------------------------------------------------
# Loading


def is_torch_dist(path: str | Path) -> bool:
    p = Path(path)
    return (p / "metadata.json").is_file() or (p / "latest_checkpointed_iteration.txt").is_file()


def load_weights(model, source: str | Path, shape: ModelShape) -> None:
    """Fill this rank's parameters from an HF directory or a torch_dist checkpoint (any TP layout),
    one full tensor at a time; every parameter must be found."""
    params = {g: p for g, _, p in named_local_params(model)}
    rules = {r.megatron: r for r in rules_for(shape)}
    if shape.tie_word_embeddings and "output_layer.weight" in params:
        # A tied model's last PP stage keeps its own copy of the embedding as the output layer.
        rules["output_layer.weight"] = rules["embedding.word_embeddings.weight"]
    missing = [g for g in params if g not in rules]
    if missing:
        raise RuntimeError(f"no conversion rule for megatron parameter(s) {missing[:5]}")
    read = _hf_reader(source) if not is_torch_dist(source) else _torch_dist_reader(source, shape)
    with torch.no_grad():
        for g, p in params.items():
            full = read(rules[g], shape)
            piece = shard_for_rank(g, full.to(torch.float32), p)
            if piece.shape != p.shape:
                raise UserError(f"{source}: {g} has shape {list(piece.shape)} for this rank, the model expects "
                                f"{list(p.shape)}; the checkpoint does not match the model's config.json.")
            p.copy_(piece)


def _hf_reader(source: str | Path):
    from safetensors import safe_open

    src = Path(source)
    files = sorted(src.glob("*.safetensors"))
    if not files:
        raise UserError(f"{src} has no *.safetensors files; pass a Hugging Face model directory or a torch_dist checkpoint.")
    where: dict[str, Path] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as h:
            for k in h.keys():
                where[k] = f

    def read(rule: Rule, shape: ModelShape) -> torch.Tensor:
        tensors = []
        for n in rule.hf:
            if n not in where:
                raise UserError(f"{src} has no tensor {n}; it does not match its config.json ({shape.architecture}).")
            with safe_open(str(where[n]), framework="pt") as h:
                tensors.append(h.get_tensor(n))
        return hf_to_megatron(rule, tensors, shape)

    return read


def _torch_dist_reader(source: str | Path, shape: ModelShape):
    from miles.ckpt.convert.torch_dist import TorchDistReader, resolve_checkpoint_dir

    reader = TorchDistReader(resolve_checkpoint_dir(Path(source)), shape).__enter__()

    def read(rule: Rule, _shape: ModelShape) -> torch.Tensor:
        return reader.read([rule.megatron])[rule.megatron]

    return read


def read_hf_config(hf_dir: str | Path) -> ModelShape:
    path = Path(hf_dir) / "config.json"
    if not path.is_file():
        raise UserError(f"--hf-checkpoint {hf_dir} has no config.json; the megatron trainer builds its model from it.")
    return ModelShape.from_hf_config(json.loads(path.read_text()), source=str(path))


# --------------------------------------------------------------------------------------------------
# Gathering (weight sync, checksums, exports)


def owner_stage(name: str, shape: ModelShape, pp: int) -> int:
    """The PP stage holding megatron tensor `name` (uniform layer split, as megatron-core builds it)."""
    if name.startswith("embedding."):
        return 0
    m = _LAYER.match(name)
    if m:
        return int(m[1]) // (shape.num_layers // pp)
    return pp - 1


def iter_full_megatron_tensors(model, shape: ModelShape, rules: list[Rule] | None = None) -> Iterator[tuple[str, torch.Tensor | None]]:
    """Collective on every rank: (megatron name, full tensor) in rule order. On each rank the tensor
    is the full value when this rank's PP group received it (every rank does), gathered over TP and
    broadcast from the owning PP stage."""
    from megatron.core import parallel_state as ps

    pp = ps.get_pipeline_model_parallel_world_size()
    pp_rank = ps.get_pipeline_model_parallel_rank()
    params = {g: p for g, _, p in named_local_params(model)}
    shapes = megatron_shapes(shape)
    ep = ps.get_expert_model_parallel_world_size()
    for rule in rules if rules is not None else rules_for(shape):
        name = rule.megatron
        stage = owner_stage(name, shape, pp)
        e = _EXPERT.match(name)
        if e and ep > 1:
            full = _gather_expert(name, params, shape, stage, pp_rank)
        elif stage == pp_rank:
            full = gather_full(name, params[name], shape.vocab_size)
        else:
            full = torch.empty(shapes[name], dtype=_dtype_of(params), device=_device_of(params))
        if pp > 1:
            group = ps.get_pipeline_model_parallel_group()
            full = on_group_device(full, group)  # the receive buffer too: NCCL refuses CPU tensors
            dist.broadcast(full, src=dist.get_global_rank(group, stage), group=group)
        yield name, full


def _dtype_of(params: dict) -> torch.dtype:
    return next(iter(params.values())).dtype


def _device_of(params: dict) -> torch.device:
    return next(iter(params.values())).device


def _gather_expert(name: str, params: dict, shape: ModelShape, stage: int, pp_rank: int) -> torch.Tensor:
    """Expert `name` (global index) lives on one EP rank: broadcast it over the EP group."""
    from megatron.core import parallel_state as ps

    shapes = megatron_shapes(shape)
    e = _EXPERT.match(name)
    num_local = shape.num_experts // ps.get_expert_model_parallel_world_size()
    owner = int(e[2]) // num_local
    full = (gather_full(name, params[name], shape.vocab_size) if name in params
            else torch.empty(shapes[name], dtype=_dtype_of(params), device=_device_of(params)))
    if stage == pp_rank:
        group = ps.get_expert_model_parallel_group()
        full = on_group_device(full, group)
        dist.broadcast(full, src=dist.get_global_rank(group, owner), group=group)
    return full
