"""The real-model recipes as data: upstream launchers' defaults, layouts, SGLang options, env vars.

Each entry names the upstream launcher it follows (`source`). Values upstream passes as flags that
SGLang 0.5.23 no longer has are written in today's spelling (`--sglang-cuda-graph-max-bs` →
`sglang_cuda_graph_max_bs_decode`, `--sglang-enable-dp-attention --sglang-dp-size 8` →
`sglang_attn_dp_size`), and options miles does not have yet (megatron's recompute, CPU optimizer
offload, rollout routing replay) are left out rather than faked.
"""

from __future__ import annotations

from recipes.catalog.spec import HubFiles, ModelRecipe, TrainLayout

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
        train_layout=TrainLayout(tp=2),
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
        train_layout=TrainLayout(tp=4, ep=8),
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
        train_layout=TrainLayout(pp=8, ep=4),
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
        train_layout=TrainLayout(tp=4, ep=8),
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
        train_layout=TrainLayout(tp=8, pp=8, cp=4, ep=32),
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
