"""The real-model recipes as data: upstream launchers' defaults, layouts, SGLang options, env vars.

Each entry names the upstream launcher it follows (`source`). Values upstream passes as flags that
SGLang 0.5.23 no longer has are written in today's spelling (`--sglang-cuda-graph-max-bs` →
`sglang_cuda_graph_max_bs_decode`, `--sglang-enable-dp-attention --sglang-dp-size 8` →
`sglang_attn_dp_size`), and options miles does not have (rollout routing replay, dropout and fusion
switches) are left out rather than faked.

`megatron` is upstream's training layout as engine option values (TP/PP/CP/EP/ETP, sequence
parallelism, recompute, token-budget batches, bf16, TransformerEngine attention, CPU optimizer
offload); the recipe applies it under `--train-backend megatron` (the recipes' default). Values no
trainer runs yet stay in (the plan says what the run needs) and `train` refuses them, listing each
(miles/config/trainer_support.py). `hf_config` holds the numbers of each model's `config.json` (or,
for DeepSeek-V4-Flash, of upstream's megatron model arguments), which the memory plan counts.
"""

from __future__ import annotations

from recipes.catalog.spec import HubFiles, ModelRecipe

DAPO = HubFiles("zhuzilin/dapo-math-17k", "dapo-math-17k", "dataset")
AIME = HubFiles("zhuzilin/aime-2024", "aime-2024", "dataset")
MODEL_FILES = ("*.json", "*.safetensors", "*.py", "*.txt", "*.model", "*.tiktoken", "tokenizer*")

# GRPO and Adam as every upstream math launcher sets them.
GRPO_MATH = {
    "advantage_estimator": "grpo",
    "eps_clip": 0.2,
    "eps_clip_high": 0.28,
    "entropy_coef": 0.0,
    "lr": 1e-6,
    "lr_decay_style": "constant",
    "weight_decay": 0.1,
    "adam_beta1": 0.9,
    "adam_beta2": 0.98,
    "input_key": "prompt",
    "label_key": "label",
    "apply_chat_template": True,
    "rollout_shuffle": True,
    "rm_type": "math",
    "num_rollout": 3000,
    "rollout_batch_size": 32,
    "n_samples_per_prompt": 8,
    "global_batch_size": 256,
    "rollout_max_response_len": 8192,
    "eval_interval": 20,
    "n_samples_per_eval_prompt": 16,
    "eval_max_response_len": 16384,
    "save_interval": 20,
}
# What every upstream megatron launcher adds: bf16 (upstream's default), TransformerEngine with flash
# attention, full recompute of every layer, token-budget micro-batches, the distributed optimizer.
MEGATRON = {
    "bf16": True,
    "transformer_impl": "transformer_engine",
    "attention_backend": "flash",
    "recompute_granularity": "full",
    "recompute_method": "uniform",
    "recompute_num_layers": 1,
    "use_dynamic_batch_size": True,
    "use_distributed_optimizer": True,
}
CPU_ADAM = {"optimizer_cpu_offload": True}  # upstream: --optimizer-cpu-offload --use-precision-aware-optimizer


def layout(tp: int = 1, pp: int = 1, cp: int = 1, ep: int = 1, etp: int = 1, *, max_tokens: int, **more) -> dict:
    """Upstream's megatron options for one model, by engine option name."""
    return {
        **MEGATRON,
        "tensor_model_parallel_size": tp,
        "sequence_parallel": tp > 1,
        "pipeline_model_parallel_size": pp,
        "context_parallel_size": cp,
        "expert_model_parallel_size": ep,
        "expert_tensor_parallel_size": etp,
        "max_tokens_per_gpu": max_tokens,
        **more,
    }


QWEN3_4B = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 2560, "num_hidden_layers": 36,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 9728,
    "vocab_size": 151936, "tie_word_embeddings": True,
}
QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 2048, "num_hidden_layers": 48,
    "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "intermediate_size": 6144,
    "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8, "vocab_size": 151936,
    "tie_word_embeddings": False,
}
# From upstream's megatron model arguments (scripts/models/deepseek-v4-flash.py): MLA-style attention with
# DeepSeek-V4's own additions, which model_size.py does not count (it says so).
DEEPSEEK_V4_FLASH = {
    "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4", "hidden_size": 4096, "num_hidden_layers": 43,
    "num_attention_heads": 64, "q_lora_rank": 1024, "kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 448,
    "v_head_dim": 512, "intermediate_size": 2048, "moe_intermediate_size": 2048, "n_routed_experts": 256,
    "n_shared_experts": 1, "num_experts_per_tok": 6, "first_k_dense_replace": 0, "vocab_size": 129280,
    "tie_word_embeddings": False, "quantization_config": {"quant_method": "fp8"},
}
GLM_47_FLASH = {
    "architectures": ["Glm4MoeLiteForCausalLM"], "model_type": "glm4_moe_lite", "hidden_size": 2048, "num_hidden_layers": 47,
    "num_attention_heads": 20, "q_lora_rank": 768, "kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128,
    "v_head_dim": 256, "intermediate_size": 10240, "moe_intermediate_size": 1536, "n_routed_experts": 64,
    "n_shared_experts": 1, "num_experts_per_tok": 4, "first_k_dense_replace": 1, "vocab_size": 154880,
    "tie_word_embeddings": False, "num_nextn_predict_layers": 1, "topk_method": "noaux_tc", "n_group": 1,
}
KIMI_K2 = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "kimi_k2", "hidden_size": 7168, "num_hidden_layers": 61,
    "num_attention_heads": 64, "num_key_value_heads": 64, "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 128, "v_head_dim": 128, "intermediate_size": 18432, "moe_intermediate_size": 2048,
    "n_routed_experts": 384, "n_shared_experts": 1, "num_experts_per_tok": 8, "first_k_dense_replace": 1,
    "vocab_size": 163840, "tie_word_embeddings": False, "topk_method": "noaux_tc", "n_group": 1,
    "quantization_config": {"quant_method": "fp8"},
}

DEBUG_MINIMAL = {"num_rollout": 2, "rollout_max_response_len": 100, "eval_interval": None, "save_interval": 2}

# DeepSeek-V4's deterministic training (upstream run_deepseek_v4.py): what --train-deterministic adds.
DETERMINISTIC_ENV = {"NCCL_ALGO": "Ring", "NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0", "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}

RECIPES: tuple[ModelRecipe, ...] = (
    ModelRecipe(
        name="qwen3-4b",
        summary="Qwen3-4B, GRPO on DAPO-Math-17k with AIME-2024 eval; one 8-GPU node, colocated SGLang engines of 2 GPUs.",
        model=HubFiles("Qwen/Qwen3-4B", "Qwen3-4B", allow_patterns=MODEL_FILES),
        num_nodes=1,
        num_gpus_per_node=8,
        hardware="H100",
        megatron=layout(tp=2, cp=4, max_tokens=9216),
        hf_config=QWEN3_4B,
        rollout_gpus_per_engine=2,
        colocate=True,
        engine={**GRPO_MATH, "rollout_temperature": 1.0, "eval_top_p": 0.7, "sglang_mem_fraction_static": 0.7},
        debug_engine=DEBUG_MINIMAL,
        datasets=(DAPO, AIME),
        source="scripts/run_qwen3_4b.py",
    ),
    ModelRecipe(
        name="qwen3-30b-a3b",
        summary="Qwen3-30B-A3B (MoE), GRPO on DAPO-Math-17k; one 8-GPU H100 node, colocated SGLang engines of 8 GPUs.",
        model=HubFiles("Qwen/Qwen3-30B-A3B", "Qwen3-30B-A3B", allow_patterns=MODEL_FILES),
        num_nodes=1,
        num_gpus_per_node=8,
        hardware="H100",
        megatron=layout(tp=4, ep=8, max_tokens=32768, **CPU_ADAM),
        hf_config=QWEN3_30B_A3B,
        rollout_gpus_per_engine=8,
        colocate=True,
        engine={
            **GRPO_MATH,
            "rollout_temperature": 0.8,
            "eval_top_p": 0.7,
            "sglang_mem_fraction_static": 0.7,
            "sglang_cuda_graph_max_bs_decode": 512,
        },
        debug_engine=DEBUG_MINIMAL,
        datasets=(DAPO, AIME),
        source="scripts/run_qwen3_30b_a3b.py (H100, 1 node)",
    ),
    ModelRecipe(
        name="deepseek-v4-flash-fp8",
        summary="DeepSeek-V4-Flash (FP8 rollout), GRPO on DAPO-Math-17k; 8 nodes × 8 GPUs, deterministic training by default.",
        model=HubFiles("sgl-project/DeepSeek-V4-Flash-FP8", "DeepSeek-V4-Flash-FP8", allow_patterns=MODEL_FILES),
        num_nodes=8,
        num_gpus_per_node=8,
        hardware="H200",
        # upstream: FP8 training (blockwise e4m3) by default, --micro-batch-size 1 --max-tokens-per-gpu 2048
        megatron=layout(pp=8, ep=4, max_tokens=2048, fp8_format="e4m3", **CPU_ADAM),
        hf_config=DEEPSEEK_V4_FLASH,
        rollout_gpus_per_engine=4,
        colocate=True,
        engine={
            **GRPO_MATH,
            "rollout_temperature": 0.8,
            "num_steps_per_rollout": 1,
            "global_batch_size": 256,
            "eval_top_p": 0.7,
            "update_weight_buffer_size": 1024**3,
            "sglang_mem_fraction_static": 0.7,
        },
        debug_engine=DEBUG_MINIMAL,
        env={
            "SGLANG_SKIP_CHECKPOINT_LOAD_CHECK": "1",
            "SGLANG_DSV4_FP4_EXPERTS": "0",
            "SGLANG_HEALTH_CHECK_TIMEOUT": "120",
            "SGLANG_DG_CACHE_DIR_PER_PROCESS": "1",
            "SGLANG_OPT_FP8_WO_A_GEMM": "0",
        },
        datasets=(DAPO, AIME),
        default_mode="debug_minimal",
        train_deterministic=True,
        source="scripts/run_deepseek_v4.py (Flash, 8 nodes)",
    ),
    ModelRecipe(
        name="glm-4.7-flash",
        summary="GLM-4.7-Flash (MoE) with EAGLE speculative rollouts, GRPO on DAPO-Math-17k; one 8-GPU H200 node.",
        model=HubFiles("zai-org/GLM-4.7-Flash", "GLM-4.7-Flash", allow_patterns=MODEL_FILES),
        num_nodes=1,
        num_gpus_per_node=8,
        hardware="H200",
        megatron=layout(tp=4, ep=8, max_tokens=32768, **CPU_ADAM),
        hf_config=GLM_47_FLASH,
        rollout_gpus_per_engine=1,  # 20 attention heads: the engine's TP must divide 20
        colocate=True,
        engine={
            **GRPO_MATH,
            "rollout_temperature": 1.0,
            "eval_temperature": 0.6,
            "eval_top_p": 0.95,
            "sglang_mem_fraction_static": 0.7,
            "sglang_speculative_algorithm": "EAGLE",
            "sglang_speculative_num_steps": 2,
            "sglang_speculative_eagle_topk": 1,
            "sglang_speculative_num_draft_tokens": 3,
        },
        debug_engine=DEBUG_MINIMAL,
        datasets=(DAPO, AIME),
        source="scripts/run_glm47_flash.py (H200)",
    ),
    ModelRecipe(
        name="kimi-k2",
        summary="Kimi-K2-Instruct, GRPO with dynamic sampling on DAPO-Math-17k; 32 nodes × 8 GPUs, SGLang engines of 16 GPUs with DP attention.",
        model=HubFiles("moonshotai/Kimi-K2-Instruct", "Kimi-K2-Instruct", allow_patterns=MODEL_FILES),
        num_nodes=32,
        num_gpus_per_node=8,
        hardware="H200",
        megatron=layout(tp=8, pp=8, cp=4, ep=32, max_tokens=16384, **CPU_ADAM),
        hf_config=KIMI_K2,
        rollout_gpus_per_engine=16,
        colocate=True,
        engine={
            **GRPO_MATH,
            "num_rollout": 100,
            "rollout_batch_size": 128,
            "over_sampling_batch_size": 256,
            "dynamic_sampling_filter_path": "miles.rollout.filters.check_reward_nonzero_std",
            "num_steps_per_rollout": 4,
            "global_batch_size": 256,
            "rollout_max_response_len": 32768,
            "rollout_temperature": 1.0,
            "n_samples_per_eval_prompt": 8,
            "eval_max_response_len": 32768,
            "eval_top_p": 1.0,
            "update_weight_buffer_size": 4 * 512 * 1024**2,
            "sglang_mem_fraction_static": 0.7,
            "sglang_attn_dp_size": 8,
            "sglang_moe_dense_tp_size": 1,
            "sglang_enable_dp_lm_head": True,
            "sglang_ep_size": 16,
        },
        debug_engine=DEBUG_MINIMAL,
        datasets=(DAPO, AIME),
        source="scripts/run_kimi_k2.py (Kimi-K2-Instruct)",
    ),
)
