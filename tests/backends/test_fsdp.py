"""FSDP2 (`--train-backend fsdp`) over gloo: two spawned ranks shard the tiny Qwen3 with torch's
`fully_shard`, and

- train like one process: per-step losses and grad norms within 1e-5 of DP=1 (whitened advantages
  over both ranks, KL and entropy terms, rewards that vary, so every gradient is non-zero);
- a per-rank DCP checkpoint taken half way resumes bit for bit (weights, losses, every rank's RNG);
- the weight buckets for the rollout engines are the full HF-named weights: every rank iterates the
  same number of buckets, only rank 0 holds tensors, and they equal, by checksum, an HF export of
  torch's own full state dict (a separate gather path), which `from_pretrained` loads;
- the same holds with tied embeddings (one parameter under two names).

The shards really are shards: the checkpoint's per-rank files each hold half of every weight.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from dp_worker import full_weights, spawn, train_reference_rollouts
from safetensors.torch import load_file


def _read(run_dir: Path):
    weights = torch.load(run_dir / "weights.pt", weights_only=True)
    losses = json.loads((run_dir / "losses.json").read_text())
    norms = json.loads((run_dir / "grad_norms.json").read_text())
    rngs = [json.loads((run_dir / f"rank{r}_rng.json").read_text()) for r in range(2)]
    return weights, losses, norms, rngs


@pytest.fixture(scope="module")
def fsdp2(tiny_hf_dir, tmp_path_factory) -> Path:
    out_dir = tmp_path_factory.mktemp("fsdp2")
    spawn(2, tiny_hf_dir, str(out_dir), train_backend="fsdp", buckets=True)
    return out_dir


@pytest.fixture(scope="module")
def dp1(tiny_hf_dir):
    trainer, losses, norms = train_reference_rollouts(tiny_hf_dir)
    return full_weights(trainer), losses, norms


def test_two_fsdp_ranks_train_like_one_process(dp1, fsdp2):
    ref_weights, ref_losses, ref_norms = dp1
    weights, losses, norms, _ = _read(fsdp2 / "straight")
    assert all(n > 0 for n in ref_norms), ref_norms  # something was trained
    assert losses == pytest.approx(ref_losses, abs=1e-5, rel=0), (ref_losses, losses)
    # A sharded gradient that was averaged instead of summed (FSDP's default) halves the norm.
    assert norms == pytest.approx(ref_norms, rel=1e-5), (ref_norms, norms)
    assert max((weights[k] - ref_weights[k]).abs().max().item() for k in ref_weights) <= 1e-5


def test_fsdp_checkpoint_is_per_rank_and_resume_is_bit_exact(fsdp2):
    import torch.distributed.checkpoint as dcp

    s_weights, s_losses, _, s_rngs = _read(fsdp2 / "straight")
    r_weights, r_losses, _, r_rngs = _read(fsdp2 / "resumed")
    ckpt = fsdp2 / "resumed" / "ckpt"
    assert sorted(p.name for p in ckpt.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    # Sharded, not replicated: each rank wrote its own half of a weight (two chunks, one per rank).
    meta = dcp.FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata
    chunks = meta["model.model.layers.0.mlp.up_proj.weight"].chunks
    first, second = sorted(chunks, key=lambda c: c.offsets[0])
    assert (first.offsets[0], second.offsets[0]) == (0, first.sizes[0])
    assert r_losses == s_losses
    assert all(torch.equal(r_weights[k], s_weights[k]) for k in s_weights)
    assert r_rngs == s_rngs
    # What `miles eval --checkpoint` reads, with no process group: the full HF-named weights.
    from miles.backends.torch.checkpoint import read_model_weights

    whole = read_model_weights(str(ckpt))
    assert {k: v.shape for k, v in whole.items()} == {k: v.shape for k, v in s_weights.items()}


def test_fsdp_weight_buckets_are_the_hf_export(fsdp2):
    from transformers import AutoModelForCausalLM

    from miles.rollout.engine.base import weights_checksum

    run = fsdp2 / "straight"
    per_rank = [json.loads((run / f"buckets_rank{r}.json").read_text()) for r in range(2)]
    assert per_rank[0]["num_buckets"] == per_rank[1]["num_buckets"] > 1  # every rank walked every bucket
    assert per_rank[0]["num_tensors"] > 0 and per_rank[1]["num_tensors"] == 0  # only the source holds tensors
    buckets = torch.load(run / "bucket_tensors.pt", weights_only=True)
    exported = load_file(str(run / "export" / "model.safetensors"))
    assert set(buckets) == set(exported)
    assert weights_checksum(buckets.items()) == weights_checksum(exported.items()) == json.loads((run / "checksum.json").read_text())
    # ... and they are the trained weights, not the initial ones
    trained = torch.load(run / "weights.pt", weights_only=True)
    assert all(torch.equal(buckets[k], trained[k]) for k in buckets)
    model = AutoModelForCausalLM.from_pretrained(run / "export", dtype=torch.float32)
    assert torch.equal(model.model.layers[1].self_attn.q_proj.weight, buckets["model.layers.1.self_attn.q_proj.weight"])


def test_fsdp_with_tied_embeddings_syncs_the_shared_weight_once(tiny_tied_hf_dir, tmp_path):
    out_dir = tmp_path / "tied"
    spawn(2, tiny_tied_hf_dir, str(out_dir), train_backend="fsdp", buckets=True)
    buckets = torch.load(out_dir / "straight" / "bucket_tensors.pt", weights_only=True)
    trained = torch.load(out_dir / "straight" / "weights.pt", weights_only=True)
    assert "lm_head.weight" not in buckets and "model.embed_tokens.weight" in buckets  # as HF's safetensors
    assert torch.equal(trained["lm_head.weight"], trained["model.embed_tokens.weight"])  # still one weight
    assert torch.equal(buckets["model.embed_tokens.weight"], trained["model.embed_tokens.weight"])
