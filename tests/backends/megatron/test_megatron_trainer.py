"""The megatron-core trainer, run for real: gloo processes on this CPU, against a plain torch reference.

Each run spawns 1-2 ranks (_mg_workers.py) on the tiny Qwen3 of the embedded recipe (vocab 19, so TP=2 pads
the vocabulary; tied embeddings, so PP=2 keeps two copies of them). The reference (_mg_reference.py) is
a Hugging Face model trained with the same loss math by plain torch.

Default run: TP=1 (losses and log-probs vs torch, weight buckets vs an HF export). Slow (`-m slow`):
TP=2 (the same, plus a bit-exact resume and `miles convert` of its checkpoint to HF), PP=2 (parity and
resume), and the distributed optimizer with DP=2 (parity and resume through its workarounds).
"""

from __future__ import annotations

import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).parent))

import _mg_workers as _mp  # noqa: E402
from _mg_reference import TorchReference, make_train_data  # noqa: E402

warnings.filterwarnings("ignore")
ROLLOUTS = [0, 1, 2]
TOL = 1e-5


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> str:
    from miles.prepare.tiny_model import create_tiny_qwen3

    return str(create_tiny_qwen3(tmp_path_factory.mktemp("tiny") / "hf", seed=0))


def _config(hf: str, *, world: int, tp: int = 1, pp: int = 1, dist_opt: bool = False) -> dict:
    # Two optimizer steps per rollout (the second one off-policy, ratio != 1), two micro-batches
    # per DP rank, an entropy bonus: every term of the policy loss moves with the weights.
    return {"hf_checkpoint": hf, "train_backend": "megatron", "global_batch_size": 4, "num_steps_per_rollout": 2,
            "micro_batch_size": 1 if world // (tp * pp) > 1 else 2, "n_samples_per_prompt": 2, "lr": 1e-2,
            "rollout_temperature": 0.8, "entropy_coef": 0.01, "clip_grad": 1.0, "actor_num_gpus_per_node": world,
            "tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp, "use_distributed_optimizer": dist_opt}


def _reference(hf: str, config: dict) -> tuple[list[float], TorchReference]:
    from miles.config.resolve import build_config, fill_derived

    cfg = fill_derived(build_config(config))
    ref = TorchReference(hf, cfg)
    losses = []
    for seed in ROLLOUTS:
        per_step = ref.train_step(make_train_data(8, seed=seed, vocab=19))
        losses.append(sum(per_step) / len(per_step))
    return losses, ref


def _losses(result: dict) -> list[float]:
    return [m["train/loss"] for m in result["metrics"]]


def _ref_log_probs(ref: TorchReference) -> tuple[torch.Tensor, torch.Tensor]:
    data = make_train_data(4, seed=5, vocab=19)
    with torch.no_grad():
        out = [ref.log_probs(t, r, entropy=True) for t, r in zip(data["tokens"], data["response_lengths"])]
    return torch.cat([o[0] for o in out]), torch.cat([o[1] for o in out])


def _assert_matches_reference(hf: str, config: dict, result: dict) -> None:
    from miles.config.resolve import build_config, fill_derived

    lp, ent = _ref_log_probs(TorchReference(hf, fill_derived(build_config(config))))
    # Same weights: log-probs and entropies at the rollout temperature agree to float rounding.
    assert (result["initial_log_probs"] - lp).abs().max() <= TOL
    assert (result["initial_entropy"] - ent).abs().max() <= TOL
    ref_losses, ref = _reference(hf, config)
    got = _losses(result)
    assert max(abs(a - b) for a, b in zip(got, ref_losses)) <= TOL, (got, ref_losses)
    # Adam with clipping hides a wrong gradient scale from the losses; the norms before clipping do not.
    ref_norms = [sum(ref.grad_norms[2 * k : 2 * k + 2]) / 2 for k in range(len(ROLLOUTS))]
    got_norms = [m["train/grad_norm"] for m in result["metrics"]]
    assert max(abs(a - b) / b for a, b in zip(got_norms, ref_norms)) <= 1e-4, (got_norms, ref_norms)
    # The weights handed to the rollout engine are the trained weights in HF naming (TP gathered,
    # SwiGLU halves re-interleaved, vocabulary padding stripped, PP stages broadcast).
    ref_sd = ref.model.state_dict()
    synced = dict(result["bucket_tensors"])
    assert set(synced) == set(ref_sd) - ({"lm_head.weight"} if "lm_head.weight" not in synced else set())
    assert max((synced[k] - ref_sd[k]).abs().max().item() for k in synced) <= 1e-3
    # Six Adam steps at lr 1e-2 amplify rounding differences (Adam normalises tiny gradients), so
    # the trained weights agree less tightly than the losses.
    assert (result["log_probs"] - _ref_log_probs(ref)[0]).abs().max() <= 1e-3


def _assert_buckets_are_the_hf_export(result: dict, export: Path, world: int) -> None:
    """Every rank iterated the same number of buckets, only rank 0 holds tensors, and they are bit
    for bit the HF export of the same step (read back from disk)."""
    from transformers import AutoModelForCausalLM

    from miles.rollout.engine.base import weights_checksum

    per_rank = result["per_rank"]
    assert len({(c, n) for c, n, _ in per_rank}) == 1 and per_rank[0][1] > 1
    assert per_rank[0][2] > 0 and all(t == 0 for _, _, t in per_rank[1:])
    on_disk = {}
    for f in sorted(export.glob("*.safetensors")):
        on_disk.update(load_file(f))
    assert weights_checksum(on_disk.items()) == weights_checksum(result["bucket_tensors"]) == result["checksum"]
    exported = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32)
    assert torch.equal(exported.model.embed_tokens.weight, on_disk["model.embed_tokens.weight"])


@pytest.mark.parametrize("layout", ["packed", "padded"])
def test_tp1_matches_torch_and_weight_buckets_are_the_hf_export(hf_dir, tmp_path, layout):
    config = _config(hf_dir, world=1)
    result = _mp.run(1, {"config": config, "rollouts": ROLLOUTS, "log_probs_seed": 5, "layout": layout,
                         "export_hf": str(tmp_path / "export"), "bucket_bytes": 20_000}, tmp_path)
    _assert_matches_reference(hf_dir, config, result)
    _assert_buckets_are_the_hf_export(result, tmp_path / "export", 1)


def test_bf16_trains_bf16_params_from_fp32_main_params_and_resumes_bit_exact(hf_dir, tmp_path):
    """--bf16 is megatron-core's mixed precision: bf16 parameters, fp32 gradient buffers, fp32 main
    parameters and Adam moments in the optimizer. Its log-probs are the fp32 ones to bf16 rounding
    (not bit-equal: bf16 really ran), its losses follow fp32 training, a resume is bit-exact and the
    weights reach an fp32 engine as fp32."""
    config = {**_config(hf_dir, world=1), "bf16": True}
    first = _mp.run(1, {"config": config, "rollouts": ROLLOUTS, "log_probs_seed": 5, "save_after": 0,
                        "save": str(tmp_path / "ckpt")}, tmp_path)
    assert first["dtypes"] == {"params": {"torch.bfloat16"}, "grads": {"torch.float32"},
                               "main_params": {"torch.float32"}, "adam": {"torch.float32"}}, first["dtypes"]
    from miles.config.resolve import build_config, fill_derived

    lp, _ = _ref_log_probs(TorchReference(hf_dir, fill_derived(build_config(_config(hf_dir, world=1)))))
    diff = (first["initial_log_probs"] - lp).abs().max().item()
    assert 0 < diff <= 0.1, diff
    ref_losses, _ = _reference(hf_dir, _config(hf_dir, world=1))
    assert max(abs(a - b) for a, b in zip(_losses(first), ref_losses)) <= 0.03, (_losses(first), ref_losses)
    assert {t.dtype for _, t in first["bucket_tensors"]} == {torch.float32}
    resumed = _mp.run(1, {"config": config, "rollouts": ROLLOUTS[1:], "load": str(tmp_path / "ckpt")}, tmp_path)
    assert _losses(resumed) == _losses(first)[1:]
    assert resumed["checksum"] == first["checksum"]


def test_tp2_log_probs_come_from_each_ranks_vocabulary_slice_and_equal_tp1(hf_dir, tmp_path):
    """TP=2 hands each rank the logits of 10 of the 20 padded vocabulary columns (no rank holds all 19
    real ones) and takes the softmax over the TP group (vocab_parallel.py): log-probs and entropies at
    the rollout temperature equal TP=1's, where the one rank holds them all."""
    (tmp_path / "tp1").mkdir(), (tmp_path / "tp2").mkdir()
    one = _mp.run(1, {"config": _config(hf_dir, world=1), "rollouts": [], "log_probs_seed": 5}, tmp_path / "tp1")
    two = _mp.run(2, {"config": _config(hf_dir, world=2, tp=2), "rollouts": [], "log_probs_seed": 5}, tmp_path / "tp2")
    assert (one["logits_width"], two["logits_width"]) == (19, 10)
    torch.testing.assert_close(two["initial_log_probs"], one["initial_log_probs"], rtol=0, atol=1e-5)
    torch.testing.assert_close(two["initial_entropy"], one["initial_entropy"], rtol=0, atol=1e-5)


@pytest.mark.slow  # two runs of two ranks and a convert, about 4 minutes on 2 busy cores
def test_tp2_matches_torch_syncs_hf_weights_resumes_bit_exact_and_converts(hf_dir, tmp_path):
    config = _config(hf_dir, world=2, tp=2)
    first = _mp.run(2, {"config": config, "rollouts": ROLLOUTS, "save_after": 0, "save": str(tmp_path / "ckpt"),
                        "log_probs_seed": 5, "export_hf": str(tmp_path / "export"), "bucket_bytes": 20_000}, tmp_path)
    _assert_matches_reference(hf_dir, config, first)

    _assert_buckets_are_the_hf_export(first, tmp_path / "export", 2)

    # Resume from the checkpoint written after rollout 0: the next two rollouts are bit-identical.
    resumed = _mp.run(2, {"config": config, "rollouts": ROLLOUTS[1:], "load": str(tmp_path / "ckpt")}, tmp_path)
    assert _losses(resumed) == _losses(first)[1:]
    assert [m["train/grad_norm"] for m in resumed["metrics"]] == [m["train/grad_norm"] for m in first["metrics"]][1:]
    assert resumed["checksum"] == first["checksum"]

    # The TP=2 checkpoint (padded vocabulary, optimizer state alongside) converts to HF with the CLI
    # and loads with from_pretrained; its weights are those of rollout 0 (not the initial ones).
    r = subprocess.run([sys.executable, "-m", "miles_cli.main", "convert", "--from", "torch_dist", "--to", "hf",
                        "--load", str(tmp_path / "ckpt"), "--origin-hf-dir", hf_dir, "--save", str(tmp_path / "hf_back")],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    from transformers import AutoModelForCausalLM

    back = AutoModelForCausalLM.from_pretrained(tmp_path / "hf_back", dtype=torch.float32)
    initial = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    assert back.model.embed_tokens.weight.shape[0] == 19
    assert not torch.equal(back.model.embed_tokens.weight, initial.model.embed_tokens.weight)
    from miles.config.resolve import build_config, fill_derived

    one = TorchReference(hf_dir, fill_derived(build_config(config)))
    one.train_step(make_train_data(8, seed=0, vocab=19))
    diff = max((back.state_dict()[k] - v).abs().max().item() for k, v in one.model.state_dict().items())
    assert diff <= 1e-3, diff


@pytest.mark.slow  # two runs of two ranks, about 3 minutes on 2 busy cores
def test_pp2_matches_torch_and_resumes_bit_exact(hf_dir, tmp_path):
    config = _config(hf_dir, world=2, pp=2)
    first = _mp.run(2, {"config": config, "rollouts": ROLLOUTS, "log_probs_seed": 5, "save_after": 0,
                        "save": str(tmp_path / "ckpt")}, tmp_path)
    _assert_matches_reference(hf_dir, config, first)
    assert first["per_rank"][0][0] == first["per_rank"][1][0]  # both stages agree on the full weights
    resumed = _mp.run(2, {"config": config, "rollouts": ROLLOUTS[1:], "load": str(tmp_path / "ckpt")}, tmp_path)
    assert _losses(resumed) == _losses(first)[1:] and resumed["checksum"] == first["checksum"]


@pytest.mark.slow  # two runs of two ranks, about 2 minutes on 2 cores
def test_distributed_optimizer_dp2_matches_torch_and_resumes_bit_exact(hf_dir, tmp_path):
    config = _config(hf_dir, world=2, dist_opt=True)
    first = _mp.run(2, {"config": config, "rollouts": ROLLOUTS, "log_probs_seed": 5, "save_after": 0,
                        "save": str(tmp_path / "ckpt")}, tmp_path)
    _assert_matches_reference(hf_dir, config, first)
    resumed = _mp.run(2, {"config": config, "rollouts": ROLLOUTS[1:], "load": str(tmp_path / "ckpt")}, tmp_path)
    assert _losses(resumed) == _losses(first)[1:]
    assert resumed["checksum"] == first["checksum"]


@pytest.mark.slow  # three runs of two ranks, about 1-2 minutes on 2 cores
def test_tp2_activation_recompute_trains_exactly_like_storing_activations(hf_dir, tmp_path):
    """--recompute-granularity full (uniform, 1 layer) and selective at TP=2 on CPU: the same losses,
    gradient norms and final weights as without recompute (bit for bit here: no dropout, and the
    recomputed forward runs the same kernels). The runs use the padded-rows layout, so this is also
    TP=2 parity with the torch reference in that layout (the other TP=2 test takes the cheaper one)."""
    base = _config(hf_dir, world=2, tp=2)
    runs = {}
    for name, extra in {"store": {}, "full": {"recompute_granularity": "full", "recompute_method": "uniform",
                                              "recompute_num_layers": 1},
                        "selective": {"recompute_granularity": "selective"}}.items():
        (tmp_path / name).mkdir()
        runs[name] = _mp.run(2, {"config": {**base, **extra}, "rollouts": ROLLOUTS, "layout": "padded",
                                 "log_probs_seed": 5}, tmp_path / name)
    _assert_matches_reference(hf_dir, base, runs["store"])
    norms = {k: [m["train/grad_norm"] for m in r["metrics"]] for k, r in runs.items()}
    assert all(n > 0 for n in norms["store"])
    for name in ("full", "selective"):
        assert max(abs(a - b) for a, b in zip(_losses(runs[name]), _losses(runs["store"]))) <= TOL
        assert norms[name] == pytest.approx(norms["store"], rel=1e-6)
        assert runs[name]["checksum"] == runs["store"]["checksum"], name


@pytest.mark.slow  # two runs of two ranks, about 2 minutes on 2 cores
def test_tp2_single_step_rollouts_reuse_the_training_forward_as_old_log_probs(hf_dir, tmp_path):
    """With one optimizer step per rollout the RL step takes the old log-probs from the training forward
    (miles/train/inputs.py), on megatron as on torch: bit for bit what the separate forward-only pass
    gives (same micro-batches, same kernels, no dropout), so every metric and the weights are equal."""
    config = {**_config(hf_dir, world=2, tp=2), "num_steps_per_rollout": 1, "global_batch_size": 8}
    runs = {}
    for name, reuse in (("reuse", True), ("separate", False)):
        (tmp_path / name).mkdir()
        runs[name] = _mp.run(2, {"config": config, "rollouts": ROLLOUTS, "reuse_on_policy_log_probs": reuse}, tmp_path / name)
    train = lambda r: [{k: v for k, v in m.items() if k.startswith("train/")} for m in r["metrics"]]  # noqa: E731
    assert train(runs["reuse"]) == train(runs["separate"])
    assert runs["reuse"]["checksum"] == runs["separate"]["checksum"]


@pytest.mark.slow  # one single-rank run per family, about 2 minutes in all
@pytest.mark.parametrize("family", ["qwen2", "llama", "qwen3_moe"])
def test_every_family_builds_from_its_hf_config_and_round_trips_bit_exact(family, tmp_path):
    """Built from the HF config and loaded through convert's rules, the model hands back exactly the
    HF tensors it was loaded from; dense families also score like HF (the MoE forward needs
    TransformerEngine in megatron-core 0.16.1, so it is only built and loaded)."""
    sys.path.insert(0, str(Path(__file__).parents[2] / "ckpt"))
    from _mp_models import make_hf_model

    make_hf_model(family, tmp_path / "hf")
    moe = family == "qwen3_moe"
    config = _config(str(tmp_path / "hf"), world=1)
    result = _mp.run(1, {"config": config, "rollouts": [], **({} if moe else {"log_probs_seed": 5})}, tmp_path)
    hf = {}  # what the HF directory stores (transformers 5 fuses MoE experts in memory, not on disk)
    for f in sorted((tmp_path / "hf").glob("*.safetensors")):
        hf.update(load_file(f))
    assert set(hf) == {n for n, _ in result["bucket_tensors"]}
    for name, tensor in result["bucket_tensors"]:
        assert torch.equal(tensor, hf[name]), name
    if not moe:
        from miles.config.resolve import build_config, fill_derived

        lp, _ = _ref_log_probs(TorchReference(str(tmp_path / "hf"), fill_derived(build_config(config))))
        assert (result["initial_log_probs"] - lp).abs().max() <= TOL


@pytest.mark.parametrize("bf16, dist_opt", [
    pytest.param(True, True, id="bf16-distributed-optimizer"),
    pytest.param(False, False, id="fp32", marks=pytest.mark.slow),
])
def test_offload_releases_every_storage_and_training_resumes_bit_exact(hf_dir, tmp_path, bf16, dist_opt):
    """What --offload-train does on a GPU (`offload_to_host`, run here on the CPU's own storages): after
    every rollout the parameters, gradient buffers, fp32 main parameters and Adam moments are released to
    zero bytes, and after `onload` the next rollouts train bit for bit like a run that never offloaded
    (megatron's parameter/grad buffer views and the distributed optimizer's shards still alias)."""
    config = {**_config(hf_dir, world=1, dist_opt=dist_opt), "bf16": bf16}
    plain = _mp.run(1, {"config": config, "rollouts": ROLLOUTS}, tmp_path)
    offloaded = _mp.run(1, {"config": config, "rollouts": ROLLOUTS, "offload_each_rollout": True}, tmp_path)
    assert _losses(offloaded) == _losses(plain)
    assert offloaded["checksum"] == plain["checksum"]
    n = offloaded["num_params"]
    # bytes per parameter: the weights (bf16 2 / fp32 4), the fp32 gradient buffer 4, Adam's two fp32
    # moments 8, and under --bf16 the optimizer's fp32 main copy 4 (buffers may be padded: at least)
    per_param = 2 + 4 + 8 + 4 if bf16 else 4 + 4 + 8
    assert len(offloaded["offload"]) == len(ROLLOUTS)
    for held, freed, after in offloaded["offload"]:
        assert freed == held >= per_param * n and after == 0, (held, freed, after, per_param * n)
