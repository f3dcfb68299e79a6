"""Worker processes for the converter tests: build a megatron-core GPTModel on CPU (gloo) from a HF
config, load a converted torch_dist checkpoint into it at TP=world size, and report logits.

Run through `run_workers(world, fn_args, timeout)` (torch.multiprocessing spawn, free port, timeout).
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import torch

from miles.utils.net import free_port as _net_free_port


def free_port() -> int:
    return _net_free_port("127.0.0.1")


def build_gpt(shape):
    import torch.nn.functional as F
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    moe = dict(num_moe_experts=shape.num_experts, moe_ffn_hidden_size=shape.moe_ffn_hidden_size,
               moe_router_topk=shape.moe_router_topk, moe_token_dispatcher_type="allgather",
               moe_router_pre_softmax=not shape.moe_norm_topk_prob) if shape.is_moe else {}
    cfg = TransformerConfig(
        num_layers=shape.num_layers, hidden_size=shape.hidden_size, num_attention_heads=shape.num_attention_heads,
        num_query_groups=shape.num_query_groups, kv_channels=shape.head_dim, ffn_hidden_size=shape.ffn_hidden_size,
        normalization="RMSNorm", layernorm_epsilon=shape.norm_epsilon, gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, add_qkv_bias=shape.qkv_bias, qk_layernorm=shape.qk_layernorm,
        bias_activation_fusion=False, masked_softmax_fusion=False, persist_layer_norm=False, bias_dropout_fusion=False,
        apply_rope_fusion=False, gradient_accumulation_fusion=False, use_cpu_initialization=True,
        attention_dropout=0.0, hidden_dropout=0.0, tensor_model_parallel_size=torch.distributed.get_world_size(), **moe)
    spec = get_gpt_layer_local_spec(num_experts=shape.num_experts or None, moe_grouped_gemm=False,
                                    qk_layernorm=shape.qk_layernorm, normalization="RMSNorm")
    return GPTModel(cfg, spec, vocab_size=shape.vocab_size, max_sequence_length=64, position_embedding_type="rope",
                    rotary_base=int(shape.rotary_base), share_embeddings_and_output_weights=shape.tie_word_embeddings,
                    parallel_output=False)


def _worker(rank: int, world: int, port: int, hf_dir: str, ckpt_dir: str, out_dir: str, save_dir: str | None) -> None:
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    import json

    import torch.distributed as dist
    from datetime import timedelta

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    from megatron.core import dist_checkpointing, parallel_state

    from miles.ckpt.convert.families import ModelShape
    from miles.ckpt.megatron_compat import ensure_cpu_compat

    ensure_cpu_compat()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    shape = ModelShape.from_hf_config(json.loads((Path(hf_dir) / "config.json").read_text()))
    model = build_gpt(shape).eval()
    sharded = model.sharded_state_dict()
    keys = sorted({v.key for v in _leaves(sharded)})
    model.load_state_dict(dist_checkpointing.load(sharded, ckpt_dir), strict=True)
    ids = torch.tensor([[3, 17, 42, 5, 88, 1, 64, 9, 30, 2, 71, 7]])
    pos = torch.arange(ids.shape[1]).unsqueeze(0)
    result = {"keys": keys}
    with torch.no_grad():
        # megatron-core 0.16.1's MoE router calls a TransformerEngine GEMM (te_general_gemm) on forward,
        # so a MoE model is only loaded here, not run.
        result["logits"] = None if shape.is_moe else model(ids, pos, attention_mask=None)
        if world == 1 and not shape.is_moe:
            # The same weights put in with the two classic mistakes must change the logits.
            sd = {k: v.clone() for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
            for mistake in ("plain_qkv", "swapped_gate_up"):
                bad = dict(sd)
                from miles.ckpt.convert.mapping import split_qkv

                for k in sd:
                    if mistake == "plain_qkv" and k.endswith("linear_qkv.weight"):
                        bad[k] = torch.cat(split_qkv(sd[k], shape), dim=0)
                    if mistake == "swapped_gate_up" and k.endswith("mlp.linear_fc1.weight"):
                        g, u = sd[k].chunk(2)
                        bad[k] = torch.cat([u, g])
                model.load_state_dict(bad, strict=False)
                result[mistake] = model(ids, pos, attention_mask=None)
            model.load_state_dict(sd, strict=False)
    if save_dir is not None:
        os.makedirs(save_dir, exist_ok=True)
        dist_checkpointing.save(model.sharded_state_dict(), save_dir)
    if rank == 0:
        torch.save(result, os.path.join(out_dir, "result.pt"))
    dist.barrier()
    dist.destroy_process_group()


def _leaves(d):
    for v in d.values():
        if isinstance(v, dict):
            yield from _leaves(v)
        elif hasattr(v, "key"):
            yield v


def run_workers(world: int, hf_dir: Path, ckpt_dir: Path, out_dir: Path, save_dir: Path | None = None, timeout: float = 120) -> dict:
    """Spawn `world` workers; returns rank 0's result dict; raises if they do not finish within `timeout` s."""
    import torch.multiprocessing as mp

    ctx = mp.start_processes(_worker, args=(world, free_port(), str(hf_dir), str(ckpt_dir), str(out_dir),
                                            str(save_dir) if save_dir else None),
                             nprocs=world, join=False, start_method="spawn")
    import time

    deadline = time.monotonic() + timeout
    while not ctx.join(timeout=max(0.1, deadline - time.monotonic())):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            raise TimeoutError(f"{world} megatron worker(s) did not finish loading {ckpt_dir} within {timeout} s")
    return torch.load(out_dir / "result.pt", weights_only=False)
