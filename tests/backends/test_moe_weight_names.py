"""MoE experts reach the engines under checkpoint names (miles/utils/hf_experts.py): transformers 5
holds a Qwen3-MoE's experts fused in memory (`mlp.experts.gate_up_proj` [E, 2I, H], `down_proj`
[E, H, I]); the torch trainer's weight iterator must send what the HF checkpoint holds
(`mlp.experts.{e}.gate_proj.weight`, ...), since SGLang only logs names it does not know. The
reference is the checkpoint itself: `save_pretrained`'s safetensors keys and tensors, bit for bit."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from backend_fixtures import make_engine_cfg, make_tiny_moe_hf_dir, make_train_data
from safetensors.torch import load_file

from miles.utils.hf_experts import checkpoint_tensors, fused_slice


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory) -> str:
    return make_tiny_moe_hf_dir(tmp_path_factory.mktemp("tiny_qwen3_moe"))


def _checkpoint(directory) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(Path(directory).glob("*.safetensors")):
        out.update(load_file(f))
    return out


def _trainer(moe_dir: str, **kw):
    from miles.backends.torch import TorchBackend

    cfg = make_engine_cfg(moe_dir, micro_batch_size=4, **kw)
    return cfg, TorchBackend(cfg, rank=0, world_size=1, device="cpu")


def test_the_model_is_fused_in_memory_and_the_sync_sends_checkpoint_names_bit_exact(moe_dir):
    _, trainer = _trainer(moe_dir)
    in_memory = set(trainer.model.state_dict())
    assert "model.layers.0.mlp.experts.gate_up_proj" in in_memory  # what the test is about
    sent = dict(trainer.named_weights_for_sync())
    ckpt = _checkpoint(moe_dir)
    assert sorted(sent) == sorted(ckpt)
    assert "model.layers.0.mlp.experts.3.up_proj.weight" in sent and "model.layers.1.mlp.gate_proj.weight" in sent
    assert all(torch.equal(sent[k], ckpt[k]) for k in ckpt), [k for k in ckpt if not torch.equal(sent[k], ckpt[k])]


def test_trained_weights_are_sent_as_the_checkpoint_save_pretrained_writes(moe_dir, tmp_path):
    """After a training step (weights moved), the buckets in the engines' dtype are what saving the
    trained model writes, cast to that dtype; the tiny recipe's engines use bf16 on GPU."""
    from miles.train.step import train_rollout

    cfg, trainer = _trainer(moe_dir)
    trainer.sync_dtype = torch.bfloat16
    train_rollout(trainer, make_train_data(8, seed=1), rollout_id=0)
    trainer.model.save_pretrained(str(tmp_path / "trained"))
    ckpt = _checkpoint(tmp_path / "trained")
    sent = dict(t for bucket in trainer.iter_weight_buckets(4096) for t in bucket)
    assert sorted(sent) == sorted(ckpt)
    assert all(sent[k].dtype == torch.bfloat16 and torch.equal(sent[k], ckpt[k].to(torch.bfloat16)) for k in ckpt)
    assert not torch.equal(ckpt["model.layers.0.mlp.experts.0.gate_proj.weight"],
                           _checkpoint(moe_dir)["model.layers.0.mlp.experts.0.gate_proj.weight"])  # it trained


def test_fused_slice_is_where_each_checkpoint_tensor_lives_in_the_fused_model(moe_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32)
    params = dict(model.named_parameters())
    ckpt = _checkpoint(moe_dir)
    experts = [k for k in ckpt if ".experts." in k]
    assert len(experts) == 4 * 3
    for name in experts:
        view = fused_slice(params, name)
        assert view is not None and torch.equal(view, ckpt[name]), name
        assert view.untyped_storage().data_ptr() == params[name.rsplit(".experts.", 1)[0] + ".experts." + (
            "down_proj" if "down_proj" in name else "gate_up_proj")].untyped_storage().data_ptr()  # a view: writes land
    assert fused_slice(params, "model.layers.1.mlp.gate_proj.weight") is None  # dense: not an expert
    assert fused_slice(params, "model.layers.0.mlp.experts.9.gate_proj.weight") is None  # no such expert


def test_other_models_and_tensors_pass_through():
    t = torch.zeros(2, 3, 4)
    assert list(checkpoint_tensors([("m.experts.gate_up_proj", t)], "qwen3")) == [("m.experts.gate_up_proj", t)]
    assert [n for n, _ in checkpoint_tensors([("m.experts.gate_up_proj", t)], "qwen3_moe")] == [
        "m.experts.0.gate_proj.weight", "m.experts.0.up_proj.weight", "m.experts.1.gate_proj.weight", "m.experts.1.up_proj.weight"]
