"""The tiny Qwen3-MoE on the megatron backend on this CPU (one rank, EP=1): megatron-core's MoE
layer (router + SequentialMLP experts, no TransformerEngine) trains, which needs
`ensure_moe_router_without_te` (megatron-core 0.16.1's router names a TE-only function), and the
weights it hands the engines are the HF checkpoint's names and, before training, its tensors bit for
bit. With experts split over two ranks (EP=2, megatron-core's all-to-all token dispatcher; the
all-gather one needs the same token count on every rank and aborted gloo) the run equals the same two
ranks with every expert on each (EP=1), and the engine still gets every expert under its own name."""

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


def test_expert_parallel_two_ranks_equal_one_rank_holding_every_expert(moe_dir, tmp_path):
    """Two data-parallel ranks, experts split over them (EP=2) vs replicated (EP=1): the same losses,
    gradient norms, log-probs and trained weights (summation order aside; Adam at lr 1e-2 amplifies
    float noise to ~2e-5 after 4 steps), and the weights sent to engines carry all 4 experts per layer
    under their global names (EP rank 1's local expert 0 is expert 2)."""
    runs = {}
    for ep in (1, 2):
        config = {"hf_checkpoint": moe_dir, "train_backend": "megatron", "global_batch_size": 4, "num_steps_per_rollout": 2,
                  "micro_batch_size": 2, "n_samples_per_prompt": 2, "lr": 1e-2, "actor_num_gpus_per_node": 2,
                  "expert_model_parallel_size": ep}
        out = tmp_path / f"ep{ep}"
        out.mkdir()
        runs[ep] = _mp.run(2, {"config": config, "rollouts": [0, 1], "log_probs_seed": 5}, out)
    one, two = runs[1], runs[2]
    for a, b in zip(one["metrics"], two["metrics"], strict=True):
        for key in ("train/loss", "train/grad_norm", "train/ppo_kl"):
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-7), key
    torch.testing.assert_close(two["initial_log_probs"], one["initial_log_probs"], rtol=0, atol=1e-6)
    torch.testing.assert_close(two["log_probs"], one["log_probs"], rtol=0, atol=1e-4)
    sent_one, sent_two = dict(one["bucket_tensors"]), dict(two["bucket_tensors"])
    assert sorted(sent_two) == sorted(sent_one)
    assert {f"model.layers.{i}.mlp.experts.{e}.up_proj.weight" for i in (0, 1) for e in range(4)} <= set(sent_two)
    for name, tensor in sent_one.items():
        torch.testing.assert_close(sent_two[name], tensor, rtol=0, atol=1e-4, msg=name)
    assert two["per_rank"][0][0] == two["per_rank"][1][0]  # the checksum covers every expert on each rank
