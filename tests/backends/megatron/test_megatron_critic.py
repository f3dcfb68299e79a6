"""The PPO critic on the megatron backend (gloo worker processes): its values equal the torch critic's
for the same decoder and head, its value loss falls, TP=2 gives TP=1's values, and a checkpoint
resumes it bit for bit."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

import _mg_critic  # noqa: E402
from _mg_reference import make_train_data  # noqa: E402

warnings.filterwarnings("ignore")


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> str:
    from miles.prepare.tiny_model import create_tiny_qwen3

    return str(create_tiny_qwen3(tmp_path_factory.mktemp("tiny") / "hf", seed=0))


def _config(hf: str, *, world: int, tp: int = 1) -> dict:
    return {"hf_checkpoint": hf, "train_backend": "megatron", "advantage_estimator": "ppo", "global_batch_size": 8,
            "num_steps_per_rollout": 1, "micro_batch_size": 4, "n_samples_per_prompt": 2, "lr": 1e-2, "clip_grad": 1.0,
            "actor_num_gpus_per_node": world, "tensor_model_parallel_size": tp, "gamma": 0.9, "lambd": 0.95}


def _torch_values(hf: str, head: dict, data: dict) -> list[torch.Tensor]:
    from miles.backends.torch.value_model import ValueModel, response_values
    from miles.train.packing import pack_samples

    model = ValueModel.from_pretrained(hf, "cpu")
    model.value_head.load_state_dict(head)
    with torch.no_grad():
        flat = response_values(model, pack_samples(data, list(range(len(data["tokens"]))), "cpu"))
    return list(flat.split(data["response_lengths"]))


def test_megatron_critic_matches_torch_learns_and_resumes(hf_dir, tmp_path):
    config = _config(hf_dir, world=1)
    first = _mg_critic.run(1, {"config": config, "rollouts": [0, 0, 0, 0], "save": str(tmp_path / "ckpt")}, tmp_path)
    from transformers import AutoConfig

    data = make_train_data(8, seed=0, vocab=AutoConfig.from_pretrained(hf_dir).vocab_size)
    # The same head on both backends (its own seeded generator), so no copy is needed.
    from miles.backends.torch.value_model import ValueModel

    assert all(torch.equal(v, ValueModel.from_pretrained(hf_dir, "cpu", seed=1234).value_head.state_dict()[k]) for k, v in first["head0"].items())
    expect = _torch_values(hf_dir, first["head0"], data)
    for i, v in first["values"][0].items():
        torch.testing.assert_close(v, expect[i], atol=1e-5, rtol=0)
    losses = [m["critic/value_loss"] for m in first["metrics"]]
    assert losses[-1] < losses[0], losses
    assert {"critic/value_loss", "critic/value_clipfrac", "critic/explained_variance", "critic/value_mean"} <= set(first["metrics"][0])
    resumed = _mg_critic.run(1, {"config": config, "rollouts": [0, 0, 0], "load": str(tmp_path / "ckpt")}, tmp_path / "r")
    for a, b in zip(first["metrics"][1:], resumed["metrics"]):
        assert a["critic/value_loss"] == b["critic/value_loss"]
    assert all(torch.equal(first["head"][k], resumed["head"][k]) for k in first["head"])


def test_megatron_critic_tp2_equals_tp1(hf_dir, tmp_path):
    one = _mg_critic.run(1, {"config": _config(hf_dir, world=1), "rollouts": [1, 1]}, tmp_path / "a")
    two = _mg_critic.run(2, {"config": _config(hf_dir, world=2, tp=2), "rollouts": [1, 1]}, tmp_path / "b")
    for k in (0, 1):
        for i in one["values"][k]:
            torch.testing.assert_close(two["values"][k][i], one["values"][k][i], atol=1e-5, rtol=0)
