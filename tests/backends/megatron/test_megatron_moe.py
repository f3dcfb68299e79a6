"""The tiny Qwen3-MoE on the megatron backend on this CPU (one rank, EP=1): megatron-core's MoE
layer (router + SequentialMLP experts, no TransformerEngine) trains, which needs
`ensure_moe_router_without_te` (megatron-core 0.16.1's router names a TE-only function), and the
weights it hands the engines are the HF checkpoint's names and, before training, its tensors bit for
bit. EP=2 over gloo aborts in this build and stays refused (miles/config/trainer_support.py)."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).parent))

import _mg_workers as _mp  # noqa: E402


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory) -> str:
    from miles.prepare.tiny_model import create_tiny_qwen3_moe

    return str(create_tiny_qwen3_moe(tmp_path_factory.mktemp("tiny_moe") / "hf"))


def test_megatron_trains_the_tiny_moe_and_syncs_checkpoint_names(moe_dir, tmp_path):
    config = {"hf_checkpoint": moe_dir, "train_backend": "megatron", "global_batch_size": 4, "num_steps_per_rollout": 2,
              "micro_batch_size": 2, "n_samples_per_prompt": 2, "lr": 1e-2, "actor_num_gpus_per_node": 1}
    ckpt = {}
    for f in Path(moe_dir).glob("*.safetensors"):
        ckpt.update(load_file(f))
    untrained = _mp.run(1, {"config": config, "rollouts": []}, tmp_path)
    sent = dict(untrained["bucket_tensors"])
    assert sorted(sent) == sorted(ckpt) and "model.layers.1.mlp.experts.3.down_proj.weight" in sent
    assert all(torch.equal(sent[k], ckpt[k]) for k in ckpt)
    trained = _mp.run(1, {"config": config, "rollouts": [0, 1]}, tmp_path)
    assert all(math.isfinite(m["train/loss"]) and m["train/grad_norm"] > 0 for m in trained["metrics"])
    moved = dict(trained["bucket_tensors"])
    assert not torch.equal(moved["model.layers.0.mlp.experts.0.gate_proj.weight"], ckpt["model.layers.0.mlp.experts.0.gate_proj.weight"])
