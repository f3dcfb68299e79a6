"""Each derived default declared next to its field holds on real resolved configurations.

For a set of realistic option combinations, resolve the configuration and check, for every derived
option the user left unset, that its value equals its declared rule applied to the resolved
configuration, and that explicit values (including an explicit `--no-...`) are kept.
"""

from __future__ import annotations

import pytest

from miles.config.engine import option_specs
from miles.config.resolve import build_config, resolve
from miles.errors import UserError

BASE = {"prompt_data": "p.jsonl", "rollout_batch_size": 4, "n_samples_per_prompt": 2, "num_rollout": 3, "actor_num_gpus_per_node": 1}

CASES = [
    {},
    {"run": {"run_id": "exp1", "run_dir": "out/exp1"}},
    {"colocate": True},
    {"colocate": True, "offload_train": False},  # upstream PR #2390: explicit --no-offload-train under --colocate
    {"colocate": False, "offload_rollout": True},
    {"global_batch_size": 4},
    {"num_steps_per_rollout": 4},
    {"rollout_max_context_len": 100},
    {"eps_clip": 0.3},
    {"eps_clip": 0.3, "eps_clip_high": 0.28},
    {"reward_key": "acc", "rm_type": "math"},
    {"hf_checkpoint": "/m", "rollout_temperature": 0.7, "rollout_top_p": 0.9, "rollout_top_k": 5},
    {"input_key": "question", "label_key": "answer"},
    {"actor_num_gpus_per_node": 2, "colocate": True},
    {"train_backend": "megatron", "actor_num_gpus_per_node": 2, "tensor_model_parallel_size": 2},  # megatron on 2 workers
    {"over_sampling_batch_size": 8},
    {"advantage_estimator": "ppo", "hf_checkpoint": "/m", "lr": 3e-4, "actor_num_gpus_per_node": 2},
    {"advantage_estimator": "ppo", "critic_lr": 1e-5, "critic_load": "/c"},
]


def _explicit_and_resolved(case):
    values = {**BASE, **case}
    options = {k: v for k, v in values.items() if k != "run"}
    cfg = build_config(options, environ={})
    for key, value in values.get("run", {}).items():  # the run's identity (not an option; set by the CLI)
        setattr(cfg.run, key, value)
    return values, resolve(cfg)


@pytest.mark.parametrize("case", CASES, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()) or "defaults")
def test_declared_rules_hold(case):
    values, cfg = _explicit_and_resolved(case)
    derived = [s for s in option_specs() if s.derived is not None]
    assert len(derived) >= 12
    for s in derived:
        if s.name in values:
            assert cfg.get(s.name) == values[s.name], f"explicit {s.flag} was overwritten"
        else:
            assert cfg.get(s.name) == s.derived.rule(cfg), f"{s.flag}: value {cfg.get(s.name)!r} breaks its rule {s.derived.text!r}"


def test_offload_follows_colocate_unless_explicit():
    assert _explicit_and_resolved({"colocate": True})[1].cluster.offload_train is True
    assert _explicit_and_resolved({"colocate": False})[1].cluster.offload_train is False
    assert _explicit_and_resolved({"colocate": True, "offload_train": False})[1].cluster.offload_train is False
    assert _explicit_and_resolved({"colocate": True, "offload_rollout": False})[1].cluster.offload_rollout is False


def test_batch_knobs_fill_each_other():
    cfg = _explicit_and_resolved({"global_batch_size": 4})[1]
    assert (cfg.data.global_batch_size, cfg.data.num_steps_per_rollout) == (4, 2)
    cfg = _explicit_and_resolved({"num_steps_per_rollout": 4})[1]
    assert (cfg.data.global_batch_size, cfg.data.num_steps_per_rollout) == (2, 4)
    cfg = _explicit_and_resolved({})[1]
    assert (cfg.data.global_batch_size, cfg.data.num_steps_per_rollout) == (8, 1)


def test_a_rule_that_lies_is_caught():
    """If the code filled offload_train differently from its declaration, the rule check would fail."""
    values, cfg = _explicit_and_resolved({"colocate": True})
    cfg.cluster.offload_train = False  # what a resolve() that ignored its declaration would produce
    s = next(s for s in option_specs() if s.name == "offload_train")
    assert cfg.get("offload_train") != s.derived.rule(cfg)


@pytest.mark.parametrize(
    "values, flag",
    [
        ({"global_batch_size": 3}, "--global-batch-size"),
        ({"global_batch_size": 4, "num_steps_per_rollout": 3}, "--global-batch-size"),
        ({"num_rollout": None}, "--num-rollout"),
        ({"num_epoch": 2}, "--num-rollout"),
        ({"over_sampling_batch_size": 2}, "--over-sampling-batch-size"),
        ({"eval_interval": 5}, "--eval-interval"),
        ({"save_interval": 5}, "--save-interval"),
        ({"eval_prompt_data": ["only-a-name"]}, "--eval-prompt-data"),
        ({"rollout_max_context_len": 10, "rollout_max_prompt_len": 10}, "--rollout-max-prompt-len"),
        ({"train_backend": "megatron", "actor_num_gpus_per_node": 3, "tensor_model_parallel_size": 2}, "--tensor-model-parallel-size"),
        ({"train_backend": "megatron", "tensor_model_parallel_size": 2}, "--tensor-model-parallel-size"),
        ({"train_backend": "megatron", "device": "cpu", "fp8_format": "e4m3"}, "--fp8-format"),
        ({"train_backend": "megatron", "device": "cpu", "actor_num_gpus_per_node": 2, "tensor_model_parallel_size": 2,
          "sequence_parallel": True}, "--sequence-parallel"),
        ({"tensor_model_parallel_size": 2}, "--tensor-model-parallel-size"),
        ({"sglang_ep_size": 2}, "--sglang-ep-size"),  # an SGLang option without --rollout-backend sglang
        ({"sglang_server_concurrency": 8}, "--sglang-server-concurrency"),
        ({"use_fault_tolerance": True}, "--use-fault-tolerance"),  # no engine servers to restart
        ({"rollout_num_gpus": 2, "rollout_num_gpus_per_engine": 2}, "--rollout-num-gpus-per-engine"),
        ({"rollout_num_gpus": 0}, "--rollout-num-gpus"),
        ({"rollout_num_gpus": 2, "rollout_health_check_interval": 0}, "--rollout-health-check-interval"),
        ({"rollout_num_gpus": 2, "rollout_health_check_first_wait": -1}, "--rollout-health-check-first-wait"),
        ({"eval_max_in_flight": 4}, "--eval-max-in-flight"),
        ({"actor_num_gpus_per_node": 3}, "--global-batch-size"),
    ],
)
def test_contradictions_are_user_errors_naming_the_option(values, flag):
    with pytest.raises(UserError) as e:
        resolve(build_config({**BASE, **values}, environ={}))
    assert e.value.option == flag
    assert flag in str(e.value)


def test_environment_default_and_explicit_value():
    cfg = resolve(build_config(BASE, environ={"PROMETHEUS_PORT": "9100"}))
    assert cfg.tracking.prometheus_port == 9100
    cfg = resolve(build_config({**BASE, "prometheus_port": 9200}, environ={"PROMETHEUS_PORT": "9100"}))
    assert cfg.tracking.prometheus_port == 9200
    with pytest.raises(UserError, match=r"\$PROMETHEUS_PORT"):
        build_config(BASE, environ={"PROMETHEUS_PORT": "ninety"})


def test_option_names_are_unique_and_flags_are_kebab_case():
    specs = option_specs()
    assert len({s.name for s in specs}) == len(specs)
    assert all(s.flag == "--" + s.name.replace("_", "-") for s in specs)


def test_upstream_names_and_defaults_users_know():
    d = {s.flag: s for s in option_specs()}
    assert d["--update-weight-buffer-size"].default == 536870912
    assert d["--advantage-estimator"].choices == ("grpo", "gspo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "ppo")
    assert d["--advantage-estimator"].default == "grpo"
    assert d["--eval-max-in-flight"].default == 2
    assert d["--eval-overflow-policy"].choices == ("backpressure", "skip")
    assert d["--mlflow-experiment-name"].default == "miles"
    assert d["--prometheus-port"].default == 9090 and d["--prometheus-port"].env == "PROMETHEUS_PORT"
    assert d["--offload-train"].kind == "tristate" and d["--offload-rollout"].kind == "tristate"


# --- the rules themselves, written out by hand ------------------------------------------------
# test_declared_rules_hold checks that resolve() applies each declaration, which it does generically:
# an inverted declaration (offload *off* under --colocate) would still pass it. These expectations are
# the rules as the help text states them, computed here independently of miles/config; the mutation
# test below shows every derived option's rule is pinned by them.


def hand_expected(values: dict) -> dict:
    """Each derived option's value for these explicit values, from its help text by hand."""
    defaults = {s.name: s.default for s in option_specs()}
    v = {**defaults, **values}
    samples = v["rollout_batch_size"] * v["n_samples_per_prompt"]
    gbs, steps = values.get("global_batch_size"), values.get("num_steps_per_rollout")
    if gbs is None and steps is None:
        gbs, steps = samples, 1
    elif gbs is None:
        gbs = samples // steps
    elif steps is None:
        steps = samples // gbs
    ctx = v["rollout_max_context_len"]
    run_id, run_dir = v.get("run", {}).get("run_id"), v.get("run", {}).get("run_dir")
    return {
        "offload_train": bool(v["colocate"]),
        "offload_rollout": bool(v["colocate"]),
        "rollout_max_prompt_len": None if ctx is None else ctx - 1,
        "over_sampling_batch_size": v["rollout_batch_size"],
        "num_steps_per_rollout": steps,
        "global_batch_size": gbs,
        "eval_input_key": v["input_key"],
        "eval_label_key": v["label_key"],
        "eval_temperature": v["rollout_temperature"],
        "eval_top_p": v["rollout_top_p"],
        "eval_top_k": v["rollout_top_k"],
        "eval_max_response_len": v["rollout_max_response_len"],
        "eps_clip_high": v["eps_clip"],
        "eval_reward_key": v["reward_key"],
        "lr_decay_iters": v["num_rollout"] * steps,
        "ref_load": v["hf_checkpoint"],
        # the PPO critic: the actor's layout, the policy's checkpoint and lr, only with ppo (else unset)
        "critic_num_nodes": v["actor_num_nodes"] if v["advantage_estimator"] == "ppo" else None,
        "critic_num_gpus_per_node": v["actor_num_gpus_per_node"] if v["advantage_estimator"] == "ppo" else None,
        "critic_load": v["hf_checkpoint"] if v["advantage_estimator"] == "ppo" else None,
        "critic_lr": v["lr"] if v["advantage_estimator"] == "ppo" else None,
        # tracking sinks: named after the run and kept in its directory (None before a run is known)
        "mlflow_tracking_uri": None if run_dir is None else f"sqlite:///{run_dir}/mlflow.db",
        "mlflow_run_name": run_id,
        "tensorboard_dir": None if run_dir is None else f"{run_dir}/tensorboard",
        "wandb_group": run_id,
        "wandb_dir": None if run_dir is None else f"{run_dir}/wandb",
        "prometheus_run_name": run_id,
    }


def check_hand_rules() -> None:
    """Every case: each derived option left unset has the hand-computed value (AssertionError if not)."""
    for case in CASES:
        values, cfg = _explicit_and_resolved(case)
        for name, want in hand_expected(values).items():
            if name not in values:
                assert cfg.get(name) == want, f"{name} under {case}: {cfg.get(name)!r}, by hand {want!r}"


def test_every_derived_option_has_a_hand_rule():
    assert {s.name for s in option_specs() if s.derived is not None} == set(hand_expected(BASE))


def test_hand_rules_hold():
    check_hand_rules()


def _wrong(value):
    """A plausible wrong value: the other boolean, one off, another string, something instead of None."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, (int, float)):
        return value + 1
    if isinstance(value, str):
        return value + "_x"
    return 7


WRONG_RULES = {
    # the bugs named in the issue and their kind, each as a rule a careless edit could write
    "offload_train": lambda c: not c.cluster.colocate,  # inverted: offload when NOT colocated
    "offload_rollout": lambda c: False,  # never offload
    "over_sampling_batch_size": lambda c: 2 * c.data.rollout_batch_size,
    "rollout_max_prompt_len": lambda c: c.rollout.rollout_max_context_len,  # forgets the response token
    "eps_clip_high": lambda c: 0.28,  # DAPO's clip-higher as a constant
    "lr_decay_iters": lambda c: c.data.num_rollout,  # rollouts, not optimizer steps
}


@pytest.mark.parametrize("name", sorted(hand_expected(BASE)))
def test_a_wrong_rule_is_caught(name):
    spec = next(s for s in option_specs() if s.name == name)
    right = spec.derived.rule
    wrong = WRONG_RULES.get(name, lambda c: _wrong(right(c)))
    object.__setattr__(spec.derived, "rule", wrong)  # Derived is frozen: patch it and restore below
    try:
        # caught by a hand rule, or by resolve()'s own checks rejecting what the wrong rule produced
        with pytest.raises((AssertionError, UserError)):
            check_hand_rules()
    finally:
        object.__setattr__(spec.derived, "rule", right)
