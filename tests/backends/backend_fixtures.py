"""Helpers shared by the torch backend tests: a tiny random Qwen3 written to disk (no download) and a
small synthetic rollout in the train-data format. Imported as `backend_fixtures` (pytest puts this
directory on sys.path)."""

from __future__ import annotations

import random

import torch

VOCAB = 32


def make_tiny_hf_dir(path, *, seed: int = 0, tie_word_embeddings: bool = False) -> str:
    """Save a 2-layer, hidden-32 Qwen3 causal LM (about 20k parameters) to `path`."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=128,
        tie_word_embeddings=tie_word_embeddings,
        pad_token_id=0,
        eos_token_id=2,
        bos_token_id=1,
    )
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config)
    model.save_pretrained(str(path))
    return str(path)


def make_tiny_moe_hf_dir(path, *, seed: int = 0) -> str:
    """Save a 2-layer Qwen3-MoE causal LM to `path`: layer 0 MoE (4 experts, top 2, expert width 24, so
    gate/up rows [2 x 24] differ from the hidden width 32), layer 1 a dense MLP."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=40, moe_intermediate_size=24, num_experts=4,
        num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[1], num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=128,
        tie_word_embeddings=False, pad_token_id=0, eos_token_id=2, bos_token_id=1,
    )
    torch.manual_seed(seed)
    Qwen3MoeForCausalLM(config).save_pretrained(str(path))
    return str(path)


def make_train_data(n: int, *, seed: int = 0, with_rollout_log_probs: bool = False) -> dict:
    """`n` samples: prompts of 3-6 tokens, responses of 2-7 tokens, rewards in {-1, 1}, the last
    response token of every third sample masked out (as a tool token would be)."""
    rng = random.Random(seed)
    data = {"tokens": [], "response_lengths": [], "rewards": [], "loss_masks": []}
    for i in range(n):
        prompt = [rng.randrange(3, VOCAB) for _ in range(rng.randint(3, 6))]
        response = [rng.randrange(3, VOCAB) for _ in range(rng.randint(2, 7))]
        mask = [1] * len(response)
        if i % 3 == 2:
            mask[-1] = 0
        data["tokens"].append(prompt + response)
        data["response_lengths"].append(len(response))
        data["rewards"].append(float(rng.choice([-1.0, 1.0])))
        data["loss_masks"].append(mask)
    if with_rollout_log_probs:
        data["rollout_log_probs"] = [[-rng.uniform(2.0, 4.0) for _ in m] for m in data["loss_masks"]]
    return data


def make_engine_cfg(
    hf_dir: str,
    *,
    algo=None,
    micro_batch_size: int = 2,
    deterministic: bool = True,
    global_batch_size: int | None = None,
    num_steps_per_rollout: int = 1,
    n_samples_per_prompt: int = 1,
    temperature: float = 1.0,
    **optimizer,
):
    """An EngineConfig for a `TorchBackend` on `hf_dir` with these training settings (what resolve()
    would fill for a real run: eps_clip_high, the batch knobs)."""
    from miles.config.algo import AlgoConfig
    from miles.config.engine import EngineConfig
    from miles.config.optimizer import OptimizerConfig

    cfg = EngineConfig()
    cfg.rollout.hf_checkpoint = hf_dir
    cfg.rollout.rollout_temperature = temperature
    cfg.train.micro_batch_size = micro_batch_size
    cfg.train.deterministic_mode = deterministic
    cfg.data.global_batch_size = global_batch_size
    cfg.data.num_steps_per_rollout = num_steps_per_rollout
    cfg.data.n_samples_per_prompt = n_samples_per_prompt
    optimizer.setdefault("lr", 1e-3)
    cfg.optimizer = OptimizerConfig(**optimizer)
    cfg.algo = algo or AlgoConfig()
    if cfg.algo.eps_clip_high is None:
        cfg.algo.eps_clip_high = cfg.algo.eps_clip
    return cfg
