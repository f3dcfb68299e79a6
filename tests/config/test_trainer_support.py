"""miles/config/trainer_support.py: every setting the trainers cannot run yet is refused, with its reason.

- each GAPS entry names a real option, its help says it is not run yet, and its refused value makes
  `check` raise a UserError naming the flag (the default does not);
- a plain run (defaults) has no gaps, so nothing is refused that runs;
- GPU-only gaps and unknown architectures.
"""

from __future__ import annotations

import pytest

from miles.config.engine import option_specs, spec
from miles.config.resolve import build_config, resolve
from miles.config.trainer_support import GAPS, check, gaps
from miles.errors import UserError

REFUSED = {"context_parallel_size": 2, "expert_tensor_parallel_size": 2, "optimizer_cpu_offload": True, "transformer_impl": "transformer_engine",
           "attention_backend": "flash", "fp8_format": "e4m3"}
EXTRA: dict[str, dict] = {}
# Settings a trainer implements now (their tests: tests/backends/test_bf16.py, test_dynamic_batch.py,
# tests/backends/megatron): no backend refuses them.
LIFTED = {"bf16": {"bf16": True}, "use_dynamic_batch_size": {"use_dynamic_batch_size": True, "max_tokens_per_gpu": 1024},
          "expert_model_parallel_size": {"expert_model_parallel_size": 2}}
MEGATRON_ONLY = {"expert_model_parallel_size"}  # resolve() refuses these options on the torch backends


def cfg(**values):
    base = {"prompt_data": "p.jsonl", "rollout_batch_size": 4, "n_samples_per_prompt": 2, "global_batch_size": 8,
            "num_rollout": 1, "actor_num_gpus_per_node": 4}
    return resolve(build_config({**base, **values}, environ={}))


def test_every_gap_is_an_option_whose_help_says_so():
    names = {s.name for s in option_specs()}
    assert {g.option for g in GAPS} == set(REFUSED)
    for g in GAPS:
        assert g.option in names
        assert "train refuses it, --dry-run plans it" in spec(g.option).help, g.option


def test_defaults_have_no_gaps():
    for backend in ("torch", "fsdp", "megatron"):
        assert gaps(cfg(train_backend=backend), gpu=False) == []
        check(cfg(train_backend=backend), gpu=False)


@pytest.mark.parametrize("option", sorted(REFUSED))
def test_each_refused_setting_is_a_user_error_naming_its_flag(option):
    backend = "megatron" if all(g.backends == ("megatron",) for g in GAPS if g.option == option) else "torch"
    c = cfg(train_backend="megatron" if backend == "megatron" else "torch", **{option: REFUSED[option]}, **EXTRA.get(option, {}))
    with pytest.raises(UserError) as e:
        check(c, gpu=False)
    flag = "--" + option.replace("_", "-")
    assert str(e.value).startswith("cannot train yet: ") and flag in str(e.value)
    assert e.value.option == flag


@pytest.mark.parametrize("option", sorted(LIFTED))
def test_lifted_settings_are_not_refused(option):
    for backend in ("megatron",) if option in MEGATRON_ONLY else ("torch", "fsdp", "megatron"):
        assert gaps(cfg(train_backend=backend, **LIFTED[option]), gpu=False) == [], (option, backend)


def test_gpu_gaps_and_unknown_architectures(monkeypatch):
    # Both trainers run on GPUs now (models on the device, collectives on device tensors).
    for backend in ("megatron", "torch", "fsdp"):
        assert gaps(cfg(train_backend=backend), gpu=True) == [], backend
    # The table still refuses a backend listed in it: megatron always, torch only with > 1 worker.
    from miles.config import trainer_support

    monkeypatch.setitem(trainer_support.GPU_GAPS, "megatron", ("reason m", "lift"))
    monkeypatch.setitem(trainer_support.GPU_GAPS, "torch", ("reason t", "lift"))
    assert [f for f, _ in gaps(cfg(train_backend="megatron"), gpu=True)] == ["--train-backend"]
    assert gaps(cfg(train_backend="torch", actor_num_gpus_per_node=1, global_batch_size=8), gpu=True) == []  # one worker: no reduction
    assert [s for _, s in gaps(cfg(), gpu=True)] == ["--train-backend torch on GPUs — reason t"]
    from miles.ckpt.convert.families import ARCHITECTURES

    found = gaps(cfg(), gpu=False, architecture="DeepseekV3ForCausalLM", families=ARCHITECTURES)
    assert found[0][0] == "--hf-checkpoint" and "DeepseekV3ForCausalLM" in found[0][1]
    assert gaps(cfg(), gpu=False, architecture="Qwen3MoeForCausalLM", families=ARCHITECTURES) == []


def test_token_budget_options_come_together():
    with pytest.raises(UserError, match="--use-dynamic-batch-size needs --max-tokens-per-gpu"):
        cfg(use_dynamic_batch_size=True)
    with pytest.raises(UserError, match="--max-tokens-per-gpu is the budget of --use-dynamic-batch-size"):
        cfg(max_tokens_per_gpu=1024)
    with pytest.raises(UserError, match="applies only to --train-backend megatron"):
        cfg(expert_tensor_parallel_size=2)
