"""A megatron-core GPTModel loads what the converter writes: same keys, HF logits, any TP layout.

Each test spawns gloo worker processes (tests/ckpt/_mp_megatron.py) with a timeout.
"""

from __future__ import annotations

import glob
import warnings

import pytest
import torch
from safetensors.torch import load_file

from _mp_megatron import run_workers
from _mp_models import make_hf_model
from miles.ckpt.convert import run_convert
from miles.config.convert import ConvertOptions

torch.set_num_threads(1)
warnings.filterwarnings("ignore")
IDS = torch.tensor([[3, 17, 42, 5, 88, 1, 64, 9, 30, 2, 71, 7]])
LOGIT_TOL = 1e-5  # relative to the largest |logit|; see the TP=1 test for why


def _convert(tmp_path, family, **kw):
    model = make_hf_model(family, tmp_path / "hf", **kw)
    run_convert(ConvertOptions(hf_checkpoint=str(tmp_path / "hf"), save=str(tmp_path / "td")), progress=False)
    return model


def _hf_eager_logits(tmp_path):
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", attn_implementation="eager", dtype=torch.float32).eval()
    with torch.no_grad():
        return m(IDS).logits


@pytest.mark.parametrize("family,kw", [("qwen3", {}), ("qwen2", {"tie_word_embeddings": True}), ("llama", {})])
def test_tp1_logits_match_hf_eager_within_tolerance_and_wrong_mappings_fail(tmp_path, family, kw):
    _convert(tmp_path, family, **kw)
    res = run_workers(1, tmp_path / "hf", tmp_path / "td" / "release", tmp_path)
    hf = _hf_eager_logits(tmp_path)
    # Two implementations (megatron-core's attention/MLP vs HF eager) compute the same fp32 sums in a
    # different order, and which order a matmul uses depends on the CPU's kernels (AVX2 vs AVX-512, the
    # thread split). Each logit comes out of dot products of length <= 64 over 2 layers (|logit| <= 0.6
    # here), so a reordering moves it by a few fp32 ulps: 0.0 measured on a Xeon with AVX-512, 6e-8 on
    # an AMD EPYC. LOGIT_TOL (1e-5 x max(1, max|logit|)) is >100x that, and a wrong mapping moves the
    # logits by 3e-3 or more (measured; asserted > 100x the tolerance below), so the check keeps its power.
    tol = LOGIT_TOL * max(1.0, hf.abs().max().item())
    diff = (res["logits"] - hf).abs().max().item()
    assert diff <= tol, f"{family}: megatron vs HF eager logits differ by {diff:.3g} > {tol:.3g}"
    for mistake in ("plain_qkv", "swapped_gate_up"):
        assert (res[mistake] - hf).abs().max() > 100 * tol, mistake


def test_written_keys_are_exactly_what_gpt_model_asks_for_moe(tmp_path):
    # qwen3_moe: router + 4 experts per layer; every key GPTModel requests exists and loads strictly
    # (forward is not run: megatron-core 0.16.1's router needs TransformerEngine).
    _convert(tmp_path, "qwen3_moe")
    res = run_workers(1, tmp_path / "hf", tmp_path / "td" / "release", tmp_path)
    from torch.distributed.checkpoint import FileSystemReader

    stored = set(FileSystemReader(str(tmp_path / "td" / "release")).read_metadata().state_dict_metadata)
    # (ShardedObjects such as _extra_state are stored under per-shard names; the strict load covers them.)
    assert {k for k in res["keys"] if not k.endswith("_extra_state")} <= stored
    assert "decoder.layers.mlp.experts.experts.linear_fc1.weight" in res["keys"]


@pytest.mark.slow  # two spawned gloo ranks, about 35 s on 2 cores
def test_tp1_checkpoint_loads_at_tp2_and_tp2_save_converts_back_bit_exact(tmp_path):
    model = _convert(tmp_path, "qwen3")
    res = run_workers(2, tmp_path / "hf", tmp_path / "td" / "release", tmp_path, save_dir=tmp_path / "tp2", timeout=180)
    hf = _hf_eager_logits(tmp_path)
    assert (res["logits"] - hf).abs().max() <= LOGIT_TOL * max(1.0, hf.abs().max().item())  # TP=2: another sum order
    # The TP2-written checkpoint (sharded qkv / swiglu chunks) read back at TP1 by our reader:
    run_convert(ConvertOptions(from_format="torch_dist", to_format="hf", load=str(tmp_path / "tp2"),
                               origin_hf_dir=str(tmp_path / "hf"), save=str(tmp_path / "back")), progress=False)
    back = {}
    for f in glob.glob(str(tmp_path / "back" / "*.safetensors")):
        back.update(load_file(f))
    for name, p in model.state_dict().items():
        assert torch.equal(back[name], p), name
