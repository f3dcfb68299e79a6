"""`build_config()` and `resolve()`: from option values to a complete, checked engine configuration.

Precedence, lowest first: the declared default, an environment variable declared with `env=`, the
recipe's values, the command line, `--extra-args`, and the tokens after `--` (later wins).
`resolve()` then rejects options that cannot take effect in this build (`unsupported=`, and choices
declared `unavailable=`), fills every
derived option that is still unset from the rule declared next to its field (`Derived`), and checks
the invariants between options. It never reads files or starts anything.
"""

from __future__ import annotations

import os
from typing import Any, Literal, Mapping

from miles.config.data import rollouts_for_epochs
from miles.config.engine import EngineConfig, option_specs, spec
from miles.config.layout import engine_layout, run_layout
from miles.config.values import format_value, parse_scalar
from miles.errors import UserError

Purpose = Literal["train", "eval"]


def build_config(values: Mapping[str, Any], *, environ: Mapping[str, str] | None = None) -> EngineConfig:
    """An unresolved config: declared defaults, then environment variables, then `values` (by field name)."""
    environ = os.environ if environ is None else environ
    cfg = EngineConfig()
    for spec in option_specs():
        if spec.env and spec.name not in values and environ.get(spec.env):
            cfg.set(spec.name, parse_scalar(spec, environ[spec.env], source=f"${spec.env}"))
    for name, value in values.items():
        cfg.set(name, value)
    return cfg


def effective_default(name: str, *, environ: Mapping[str, str] | None = None) -> Any:
    """The default an option really has here: its environment variable's value if set, else the declared one."""
    environ = os.environ if environ is None else environ
    from miles.config.engine import spec

    s = spec(name)
    if s.env and environ.get(s.env):
        return parse_scalar(s, environ[s.env], source=f"${s.env}")
    return s.default


def resolve(cfg: EngineConfig, *, purpose: Purpose = "train") -> EngineConfig:
    """Reject unsupported settings, fill derived defaults, check invariants. Mutates and returns `cfg`."""
    for spec in option_specs():
        if spec.unsupported and cfg.get(spec.name) != spec.default:
            raise UserError(
                f"{spec.flag} {format_value(cfg.get(spec.name))} cannot take effect: {spec.unsupported}; "
                f"remove the flag (default {format_value(spec.default)}).",
                option=spec.flag,
            )
        value = cfg.get(spec.name)
        if spec.unavailable and not isinstance(value, list) and value in spec.unavailable:
            others = ", ".join(map(str, spec.available_choices or ()))
            raise UserError(
                f"{spec.flag} {format_value(value)} cannot run in this build: {spec.unavailable[value]}; use {others}.",
                option=spec.flag,
            )
    cfg.critic.check_before_derive(cfg)
    cfg.opd.check_before_derive(cfg)
    fill_derived(cfg)
    _check(cfg, purpose)
    cfg.layout = run_layout(cfg)
    return cfg


def resolve_num_rollout(cfg: EngineConfig, num_prompts: int) -> EngineConfig:
    """--num-epoch: the number of steps once the dataset's size is known (the driver reads it from the
    rollout manager), then every option derived from it (the LR decay length) and the layout."""
    d = cfg.data
    d.num_rollout = rollouts_for_epochs(num_prompts, d.num_epoch, d.rollout_batch_size)
    fill_derived(cfg)
    cfg.layout = run_layout(cfg, device=cfg.layout.device)
    return cfg


def resolve_device(cfg: EngineConfig, device: str) -> EngineConfig:
    """The device the run picked (--device auto: CUDA when visible), and the offload settings as they take
    effect there."""
    cfg.layout = run_layout(cfg, device=device)
    return cfg


def run_environment(cfg: EngineConfig) -> dict[str, str]:
    """Environment variables the run's processes need, from the `run_env` declared on each true option."""
    env: dict[str, str] = {}
    for spec in option_specs():
        if spec.run_env and cfg.get(spec.name):
            env.update(spec.run_env)
    return env


def fill_derived(cfg: EngineConfig) -> EngineConfig:
    """Set every derived option that is still unset from its declared rule (in declaration order)."""
    for spec in option_specs():
        if spec.derived is not None and cfg.get(spec.name) is None:
            cfg.set(spec.name, spec.derived.rule(cfg))
    return cfg


def _require(condition: bool, message: str, option: str) -> None:
    if not condition:
        raise UserError(message, option=option)


def _sglang_engines(cfg: EngineConfig) -> bool:
    return cfg.rollout.rollout_backend == "sglang"


def _check_engines(cfg: EngineConfig) -> None:
    """Engine servers, the router and fault tolerance (miles/rollout/engine/fleet.py)."""
    c, ft = cfg.cluster, cfg.fault_tolerance
    _require(
        _sglang_engines(cfg) or c.rollout_num_gpus_per_engine == 1,
        "--rollout-num-gpus-per-engine must be 1 with the built-in engine (it does not shard a model across devices).",
        "--rollout-num-gpus-per-engine",
    )
    _require(
        not _sglang_engines(cfg) or cfg.rollout.rollout_dtype == "float32",
        "--rollout-dtype sets the built-in engine's dtype; with --rollout-backend sglang use --sglang-dtype instead.",
        "--rollout-dtype",
    )
    if c.rollout_num_gpus is not None:
        _require(c.rollout_num_gpus >= 1, "--rollout-num-gpus must be at least 1 (or unset for the in-process engine).", "--rollout-num-gpus")
    for name in ("rollout_health_check_interval", "rollout_health_check_timeout"):
        _require(getattr(ft, name) > 0, f"--{name.replace('_', '-')} must be positive.", f"--{name.replace('_', '-')}")
    _require(ft.rollout_health_check_first_wait >= 0, "--rollout-health-check-first-wait must be >= 0.", "--rollout-health-check-first-wait")
    _check_tensor_transfer(cfg)
    _require(
        not ft.use_fault_tolerance or c.rollout_num_gpus is not None,
        "--use-fault-tolerance restarts engine servers, and this run has none (the engine lives inside the rollout "
        "manager); add --rollout-num-gpus N or drop --use-fault-tolerance.",
        "--use-fault-tolerance",
    )


def _check_tensor_transfer(cfg: EngineConfig) -> None:
    """--update-weight-transfer-mode tensor hands engines handles to the source rank's memory
    (miles/rollout/engine/tensor_ipc.py): only engines on that node can map them, and on GPUs only the
    one engine that shares the source rank's GPU (the others do not see it)."""
    c, flag = cfg.cluster, "--update-weight-transfer-mode"
    servers = _sglang_engines(cfg) or c.rollout_num_gpus is not None
    if cfg.rollout.update_weight_transfer_mode != "tensor" or not servers:
        return  # the in-process engine takes tensors whatever the mode
    _require(
        c.rollout_num_gpus_per_engine <= c.actor_num_gpus_per_node,
        f"{flag} tensor hands the trainer's memory to engines on its own node, and --rollout-num-gpus-per-engine "
        f"{c.rollout_num_gpus_per_engine} spans nodes of {c.actor_num_gpus_per_node} GPUs (--num-gpus-per-node); use {flag} broadcast.",
        flag,
    )
    _require(
        c.actor_num_nodes == 1,
        f"{flag} tensor hands the trainer's memory to engines on its own node, and --num-nodes "
        f"{c.actor_num_nodes} puts engines on other nodes; use {flag} broadcast.",
        flag,
    )
    if c.device == "cuda":  # with "auto" the sender checks once it holds a CUDA tensor
        if _sglang_engines(cfg):
            engines = engine_layout(cfg).num_engines
        else:
            engines = c.rollout_num_gpus // c.rollout_num_gpus_per_engine
        _require(
            c.colocate and engines == 1,
            f"{flag} tensor on GPUs sends CUDA IPC handles of the trainer's GPU, which only one engine colocated "
            f"with it can open (this run has {engines} engine(s){'' if c.colocate else ', not colocated'}); "
            f"use --colocate with one engine, or {flag} broadcast.",
            flag,
        )


def _check_megatron(cfg: EngineConfig) -> None:
    """The megatron options only apply with --train-backend megatron; their layout is checked there."""
    t = cfg.train
    if t.train_backend != "megatron":
        _require(t.recompute_granularity != "selective",
                 "--recompute-granularity selective applies only to --train-backend megatron; the torch backends "
                 "recompute whole decoder layers: use --recompute-granularity full.", "--recompute-granularity")
        for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
                     "expert_model_parallel_size", "expert_tensor_parallel_size", "sequence_parallel", "recompute_method",
                     "recompute_num_layers", "use_distributed_optimizer", "transformer_impl", "fp8_format", "attention_backend",
                     "optimizer_cpu_offload"):
            flag = "--" + name.replace("_", "-")
            _require(cfg.get(name) == spec(name).default, f"{flag} applies only to --train-backend megatron; add that or drop {flag}.", flag)
        return
    from miles.config.megatron_checks import check_hardware, check_layout

    c = cfg.cluster
    check_layout(cfg, c.actor_num_nodes * c.actor_num_gpus_per_node)
    if c.device == "cpu":  # with "auto" the trainer checks once it knows the device
        check_hardware(cfg, cuda=False)


def _check_token_budget(cfg: EngineConfig) -> None:
    t = cfg.train
    _require(
        not t.use_dynamic_batch_size or t.max_tokens_per_gpu is not None,
        "--use-dynamic-batch-size needs --max-tokens-per-gpu N (the token budget of one micro-batch); add it.",
        "--use-dynamic-batch-size",
    )
    _require(
        t.max_tokens_per_gpu is None or t.use_dynamic_batch_size,
        "--max-tokens-per-gpu is the budget of --use-dynamic-batch-size; add that or drop --max-tokens-per-gpu.",
        "--max-tokens-per-gpu",
    )
    _require(t.max_tokens_per_gpu is None or t.max_tokens_per_gpu >= 1, "--max-tokens-per-gpu must be at least 1.", "--max-tokens-per-gpu")


def _check(cfg: EngineConfig, purpose: Purpose) -> None:
    d, r, c = cfg.data, cfg.rollout, cfg.cluster
    _check_engines(cfg)
    if purpose == "train":  # an eval builds no trainer: its layout and kernels are not the eval's to fix
        _check_megatron(cfg)
    from miles.config import sglang as sglang_options

    sglang_options.check(cfg)
    from miles.config import lora

    lora.check(cfg)
    for name in ("actor_num_nodes", "actor_num_gpus_per_node"):
        _require(getattr(c, name) >= 1, f"--{name.replace('_', '-')} must be at least 1.", f"--{name.replace('_', '-')}")
    _require(d.n_samples_per_prompt >= 1, "--n-samples-per-prompt must be at least 1.", "--n-samples-per-prompt")
    _require(r.rollout_max_response_len >= 1, "--rollout-max-response-len must be at least 1.", "--rollout-max-response-len")
    _require(r.rollout_temperature >= 0, "--rollout-temperature must be >= 0 (0 = greedy).", "--rollout-temperature")
    _require(0 < r.rollout_top_p <= 1, "--rollout-top-p must be in (0, 1].", "--rollout-top-p")
    _require(r.update_weight_buffer_size > 0, "--update-weight-buffer-size must be positive.", "--update-weight-buffer-size")
    if r.rollout_max_context_len is not None and r.rollout_max_prompt_len is not None:
        _require(
            r.rollout_max_prompt_len <= r.rollout_max_context_len - 1,
            "--rollout-max-prompt-len must be at most --rollout-max-context-len − 1; lower it or raise the context length.",
            "--rollout-max-prompt-len",
        )
    if cfg.eval.eval_prompt_data is not None:
        _require(
            len(cfg.eval.eval_prompt_data) % 2 == 0,
            "--eval-prompt-data takes NAME PATH pairs; give an even number of values, e.g. --eval-prompt-data arith eval.jsonl.",
            "--eval-prompt-data",
        )
    if cfg.eval.eval_interval is not None:
        _require(cfg.eval.eval_interval >= 1, "--eval-interval must be at least 1.", "--eval-interval")
        _require(
            bool(cfg.eval.eval_prompt_data),
            "--eval-interval needs eval datasets; add --eval-prompt-data NAME PATH or drop --eval-interval.",
            "--eval-interval",
        )
    if cfg.ckpt.save_interval is not None:
        _require(cfg.ckpt.save_interval >= 1, "--save-interval must be at least 1.", "--save-interval")
        _require(cfg.ckpt.save is not None, "--save-interval needs --save DIR; add it or drop --save-interval.", "--save-interval")
    o, k, t = cfg.optimizer, cfg.ckpt, cfg.tracking
    _require(r.rollout_top_k == -1 or r.rollout_top_k >= 1, "--rollout-top-k must be -1 (off) or at least 1.", "--rollout-top-k")
    for name in ("lr", "min_lr", "weight_decay", "clip_grad"):
        _require(getattr(o, name) >= 0, f"--{name.replace('_', '-')} must be >= 0.", f"--{name.replace('_', '-')}")
    _require(o.lr_warmup_iters >= 0, "--lr-warmup-iters must be >= 0.", "--lr-warmup-iters")
    _require(cfg.eval.n_samples_per_eval_prompt >= 1, "--n-samples-per-eval-prompt must be at least 1.", "--n-samples-per-eval-prompt")
    _require(cfg.eval.eval_temperature >= 0, "--eval-temperature must be >= 0 (0 = greedy).", "--eval-temperature")
    _require(cfg.eval.eval_max_response_len >= 1, "--eval-max-response-len must be at least 1.", "--eval-max-response-len")
    _require(1 <= t.prometheus_port <= 65535, "--prometheus-port must be a TCP port (1-65535).", "--prometheus-port")
    for name in ("save", "load", "save_hf"):
        value = getattr(k, name)
        _require(value is None or value.strip() != "", f"--{name.replace('_', '-')} is empty; give a directory or drop the flag.", f"--{name.replace('_', '-')}")
    if k.keep_last_checkpoints is not None:
        _require(k.keep_last_checkpoints >= 1, "--keep-last-checkpoints must be at least 1 (unset keeps all).", "--keep-last-checkpoints")
    for flag, pattern in (("--save-hf", k.save_hf), ("--save-debug-rollout-data", cfg.debug.save_debug_rollout_data)):
        if pattern:
            try:
                pattern.format(rollout_id=0)
            except (KeyError, IndexError, ValueError) as e:
                raise UserError(
                    f"{flag} {pattern!r} has a placeholder other than {{rollout_id}} ({e}); use {{rollout_id}} or none.", option=flag
                ) from None
    cfg.algo.check(d.n_samples_per_prompt)
    cfg.critic.check(cfg)
    cfg.opd.check(cfg)
    cfg.asynchrony.check(colocate=c.colocate, algo=cfg.algo, debug_rollout_only=cfg.debug.debug_rollout_only)
    cfg.reward.check()
    if purpose == "eval":
        _require(
            bool(cfg.eval.eval_prompt_data),
            "miles eval needs eval datasets; give --eval-prompt-data NAME PATH (in --extra-args or after --).",
            "--eval-prompt-data",
        )
    if purpose != "train":
        return
    _require(
        (d.num_rollout is None) != (d.num_epoch is None),
        "Give exactly one of --num-rollout and --num-epoch.",
        "--num-rollout",
    )
    _require(d.num_rollout is None or d.num_rollout >= 1, "--num-rollout must be at least 1 (to only evaluate, use `miles eval`).", "--num-rollout")
    _require(d.num_epoch is None or d.num_epoch >= 1, "--num-epoch must be at least 1.", "--num-epoch")
    _require(d.rollout_batch_size is not None and d.rollout_batch_size >= 1, "--rollout-batch-size is required (≥ 1).", "--rollout-batch-size")
    _require(d.num_steps_per_rollout >= 1, "--num-steps-per-rollout must be at least 1; lower --global-batch-size.", "--num-steps-per-rollout")
    samples = d.rollout_batch_size * d.n_samples_per_prompt
    _require(
        samples % d.global_batch_size == 0,
        f"--global-batch-size ({d.global_batch_size}) must divide --rollout-batch-size × --n-samples-per-prompt "
        f"({d.rollout_batch_size} × {d.n_samples_per_prompt} = {samples}); pick a divisor.",
        "--global-batch-size",
    )
    _require(
        d.rollout_batch_size * d.n_samples_per_prompt == d.global_batch_size * d.num_steps_per_rollout,
        f"--rollout-batch-size × --n-samples-per-prompt ({d.rollout_batch_size} × {d.n_samples_per_prompt}) must equal "
        f"--global-batch-size × --num-steps-per-rollout ({d.global_batch_size} × {d.num_steps_per_rollout}); "
        "change one of them.",
        "--global-batch-size",
    )
    _require(cfg.train.micro_batch_size >= 1, "--micro-batch-size must be at least 1.", "--micro-batch-size")
    _check_token_budget(cfg)
    _require(
        r.over_sampling_batch_size >= d.rollout_batch_size,
        "--over-sampling-batch-size must be at least --rollout-batch-size.",
        "--over-sampling-batch-size",
    )
    r.check(d.rollout_batch_size, sft=cfg.algo.loss_type == "sft_loss")
    world = c.actor_num_nodes * c.actor_num_gpus_per_node
    _require(
        cfg.train.train_backend == "megatron" or d.global_batch_size % world == 0,
        f"--global-batch-size ({d.global_batch_size}) must be divisible by the number of training workers "
        f"(--actor-num-nodes × --actor-num-gpus-per-node = {world}).",
        "--global-batch-size",
    )
    # No whole-groups requirement per worker: group statistics (GRPO/GSPO/RF++ baselines) are taken
    # over whole groups on the rollout side, and every estimator the trainer runs works per sample.
    _require(d.prompt_data is not None, "--prompt-data is required to train; give a .jsonl or .parquet file.", "--prompt-data")
