"""The memory plan: per GPU, what the trainer and the rollout engine will hold, against the hardware.

`plan_memory(cfg, size, hardware)` returns a `MemoryPlan` for one training GPU (the most loaded one:
pipeline stage 0, which holds the embedding and keeps the most micro-batches in flight) and one
engine GPU. Trainer side, in bytes:

- parameters: every parameter this GPU holds × 2 (megatron with --bf16) or 4 bytes (fp32; the torch
  backend keeps fp32 parameters under --bf16 too: they are its master weights). megatron splits the
  layers by TP × PP and the routed experts by EP × ETP × PP; torch (DDP) holds the whole model; fsdp 1/world.
- gradients: one fp32 value per parameter (megatron reduces in fp32, FSDP2 reduce-scatters in fp32).
- LoRA (`--lora-rank`): the base's parameters, plus the adapters (`lora_parameters`); gradients and
  Adam's moments for the adapters only.
- optimizer: Adam's two fp32 moments, plus megatron's fp32 main copy with --bf16; divided by the
  data-parallel size with --use-distributed-optimizer (and on fsdp); 0 on the GPU with
  --optimizer-cpu-offload.
- torch backend compute copies (`_compute_copies`): autocast's bf16 weight cache with --bf16, DDP's
  gradient buckets with more than one worker, FSDP's all-gathered units.
- activations: what backward needs per token and layer (norm inputs, Q/K/V, attention output, MLP
  inputs and its 3 × FFN SwiGLU intermediates; the routed experts' share for MoE layers; the
  s × heads attention probabilities unless a flash/fused kernel computes them), divided by TP under
  --sequence-parallel, for the tokens of one micro-batch on this GPU (--max-tokens-per-gpu with
  --use-dynamic-batch-size, else --micro-batch-size × the longest sample), over the layers of this
  stage, × the micro-batches a 1F1B pipeline keeps in flight (PP). --recompute-granularity full keeps
  only each recompute group's input plus one group's activations; selective drops the attention
  probabilities. Plus the fp32 logits and their log-softmax over the full vocabulary (megatron: over
  each TP rank's vocabulary slice).
- beside the actor, with its layout (`_beside_the_actor`): the KL reference's and the
  `--opd-type megatron` teacher's frozen parameters, and the PPO critic's whole trained state unless
  --offload-train makes the two take turns.

Engine side: SGLang takes --sglang-mem-fraction-static of the GPU for its weights (the checkpoint's
dtype, split over --rollout-num-gpus-per-engine) and KV cache; the plan checks the weights fit and
how many of the longest sequences the rest caches. Colocated with --offload-train/--offload-rollout,
the trainer and the engine take turns; otherwise both must fit at once.

It is arithmetic on the configuration, not a measurement: bench/memory_plan.py compares it with the
measured peak of the tiny models on CPU. Pure Python (no torch).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from miles.config.model_size import ModelSize

GiB = 1024**3

HARDWARE_MEMORY: dict[str, int] = {
    # Per-GPU memory as nvidia-smi reports it (MiB): H100 SXM 80 GB, H200 141 GB, B200, GB200 (NVL72).
    "H100": 81559 * 1024**2,
    "H200": 143771 * 1024**2,
    "B200": 183359 * 1024**2,
    "GB200": 189471 * 1024**2,
}

ASSUMED_PROMPT_TOKENS = 1024
"""Prompt length the plan assumes when --rollout-max-prompt-len is unset (prompts are not bounded then)."""

CUDA_CONTEXT = int(0.75 * GiB)
"""What every process that touches a GPU keeps there (CUDA context, NCCL buffers), trainer and engine alike."""


def gib(n: float) -> str:
    return f"{n / GiB:.1f} GiB"


@dataclass
class MemoryPlan:
    hardware: str | None
    capacity: int | None  # bytes per GPU, None when the hardware is unknown (cpu/auto)
    layout: str  # e.g. "TP2 PP1 CP4 EP1 ETP1 DP1"
    trainer: dict[str, int]  # name -> bytes per GPU
    engine: dict[str, int]
    details: list[str] = field(default_factory=list)  # the arithmetic, one line per item
    problems: list[str] = field(default_factory=list)  # why it does not fit (empty: it fits or is unchecked)
    fixes: list[str] = field(default_factory=list)  # options that would make it fit, each alone

    @property
    def trainer_total(self) -> int:
        return sum(self.trainer.values())

    @property
    def fits(self) -> bool:
        return not self.problems

    def lines(self) -> list[str]:
        cap = f"{self.hardware} {gib(self.capacity)} per GPU" if self.capacity else "no GPU named (--hardware cpu/auto): not checked against a device"
        out = [f"Memory plan ({self.layout}; {cap}):"]
        out += [f"  trainer {k}: {gib(v)}" for k, v in self.trainer.items()]
        out.append(f"  trainer total: {gib(self.trainer_total)}")
        out += [f"  engine {k}: {gib(v)}" for k, v in self.engine.items()]
        out += [f"  · {d}" for d in self.details]
        if self.capacity:
            out.append("  fits." if self.fits else "  DOES NOT FIT: " + "; ".join(self.problems))
        if self.fixes:
            out.append("  would fit with: " + "; ".join(self.fixes))
        return out


@dataclass(frozen=True)
class _Layout:
    tp: int
    pp: int
    cp: int
    ep: int
    etp: int
    dp: int
    expert_dp: int
    world: int


def _layout(cfg) -> _Layout:
    t, c = cfg.train, cfg.cluster
    world = c.actor_num_nodes * c.actor_num_gpus_per_node
    if t.train_backend != "megatron":
        return _Layout(1, 1, 1, 1, 1, world, world, world)
    tp, pp, cp = t.tensor_model_parallel_size, t.pipeline_model_parallel_size, t.context_parallel_size
    ep, etp = t.expert_model_parallel_size, t.expert_tensor_parallel_size
    return _Layout(tp, pp, cp, ep, etp, max(1, world // (tp * pp * cp)), max(1, world // (pp * ep * etp)), world)


def _longest_sample(cfg) -> tuple[int, str]:
    r = cfg.rollout
    prompt = r.rollout_max_prompt_len
    if prompt is None:
        return r.rollout_max_response_len + ASSUMED_PROMPT_TOKENS, f"{r.rollout_max_response_len} response + {ASSUMED_PROMPT_TOKENS} prompt tokens (assumed; --rollout-max-prompt-len is unset)"
    return prompt + r.rollout_max_response_len, f"{prompt} prompt + {r.rollout_max_response_len} response tokens"


def lora_parameters(cfg, m: ModelSize) -> int:
    """Adapter parameters of the run's LoRA (rank r on a d_in -> d_out linear: r·(d_in + d_out)), all layers;
    with --lora-adapter-path the rank is the adapter's, unknown here, so --lora-rank (0: none) counts."""
    from miles.config.lora import target_module_names

    r, h, f = cfg.lora.lora_rank, m.hidden_size, m.ffn_hidden_size
    shapes = {"q_proj": (h, m.query_width), "k_proj": (h, m.kv_width), "v_proj": (h, m.kv_width), "o_proj": (m.query_width, h),
              "gate_proj": (h, f), "up_proj": (h, f), "down_proj": (f, h)}
    names = target_module_names(cfg.lora)
    attention = sum(r * sum(shapes[n]) for n in names if n in ("q_proj", "k_proj", "v_proj", "o_proj"))
    mlp_names = [n for n in names if n in ("gate_proj", "up_proj", "down_proj")]
    dense = m.num_dense_layers if m.num_experts else m.num_layers
    expert = len(mlp_names) * r * (h + m.moe_ffn_hidden_size)  # every routed expert has its own projections
    return int(m.num_layers * attention + dense * sum(r * sum(shapes[n]) for n in mlp_names) + m.num_moe_layers * m.num_experts * expert)


def _params_here(m: ModelSize, lay: _Layout, backend: str) -> tuple[float, float]:
    """(dense, routed-expert) parameters on the most loaded GPU: pipeline stage 0 holds the embedding
    (with PP=1 the head too); megatron splits the layers by TP and the experts by EP x ETP, fsdp both by
    the world."""
    share = math.ceil(m.num_layers / lay.pp) / m.num_layers
    embed = m.embedding + (m.output_head if lay.pp == 1 else 0) + m.final_norm
    dense = (m.layer_total * share + embed) / lay.tp
    experts = m.routed_expert_total * share / (lay.ep * lay.etp)
    if backend == "fsdp":
        dense, experts = dense / lay.world, experts / lay.world
    return dense, experts


def _param_bytes(cfg) -> int:
    """--bf16 on megatron: bf16 parameters (the optimizer keeps the fp32 main copy). On torch/fsdp the
    parameters stay fp32 and are themselves the master weights (autocast / FSDP2's policy make bf16
    copies for the compute, counted in `_compute_copies`)."""
    return 2 if cfg.train.bf16 and cfg.train.train_backend == "megatron" else 4


def _trained_state(cfg, dense: float, experts: float, lay: _Layout) -> tuple[float, int, int, int, int, float]:
    """(parameters, bytes per parameter, bytes per gradient, Adam bytes per parameter, dense optimizer
    shard, optimizer state bytes) of a trained model with `dense` + `experts` parameters on this GPU:
    fp32 gradients (megatron reduces in fp32, FSDP2 reduce-scatters in fp32), Adam's two fp32 moments
    plus megatron's fp32 main copy under --bf16, sharded over DP with --use-distributed-optimizer."""
    t, o = cfg.train, cfg.optimizer
    mixed = t.bf16 and t.train_backend == "megatron"
    shard_dense = shard_experts = 1
    if t.train_backend == "megatron" and t.use_distributed_optimizer:
        shard_dense, shard_experts = lay.dp, lay.expert_dp
    opt_per_param = 8 + (4 if mixed else 0)
    optimizer = 0 if o.optimizer_cpu_offload else opt_per_param * (dense / shard_dense + experts / shard_experts)
    return dense + experts, _param_bytes(cfg), 4, opt_per_param, shard_dense, optimizer


def _trainer(cfg, m: ModelSize, lay: _Layout, details: list[str], teacher: ModelSize | None = None) -> dict[str, int]:
    t, o = cfg.train, cfg.optimizer
    backend, bf16 = t.train_backend, t.bf16
    layers_here = math.ceil(m.num_layers / lay.pp)
    share = layers_here / m.num_layers
    dense, experts = _params_here(m, lay, backend)
    n_params, p_bytes, g_bytes, opt_per_param, shard_dense, optimizer = _trained_state(cfg, dense, experts, lay)
    mixed = p_bytes == 2
    details.append(
        f"parameters here: {n_params / 1e9:.2f}B of {m.total / 1e9:.2f}B ({m.active / 1e9:.2f}B active per token) × "
        f"{p_bytes} bytes{' (bf16)' if mixed else ' (fp32)'}; gradients × {g_bytes}; Adam × {opt_per_param}"
        + (f" / DP {shard_dense}" + (f" (experts / {lay.expert_dp})" if m.num_experts else "") if shard_dense > 1 else "")
        + (" kept on the host (--optimizer-cpu-offload)" if o.optimizer_cpu_offload else "")
    )
    if m.approximate:
        details.append(f"model size approximate: {m.approximate}")
    # Activations.
    longest, longest_text = _longest_sample(cfg)
    if t.use_dynamic_batch_size and t.max_tokens_per_gpu:
        tokens, tokens_text = t.max_tokens_per_gpu, f"--max-tokens-per-gpu {t.max_tokens_per_gpu}"
        seq = min(longest, t.max_tokens_per_gpu * lay.cp)
    else:
        tokens = t.micro_batch_size * longest // lay.cp
        tokens_text = f"--micro-batch-size {t.micro_batch_size} × {longest_text}" + (f" / CP {lay.cp}" if lay.cp > 1 else "")
        seq = longest
    act_bytes = 2 if bf16 else 4
    h, f, tp = m.hidden_size, m.ffn_hidden_size, lay.tp
    sp = t.sequence_parallel and tp > 1
    split = (lambda x: x / tp)
    unsplit = (lambda x: x / tp) if sp else (lambda x: x)
    attn = unsplit(4 * h) + split(2 * m.query_width + 2 * m.kv_width)
    flash = t.attention_backend in ("flash", "fused")
    scores = 0 if flash or t.recompute_granularity == "selective" else split(2 * m.num_attention_heads * seq / lay.cp)
    dense_mlp = split(3 * f)
    moe_mlp = unsplit(m.experts_per_token * h) + m.experts_per_token * 3 * m.moe_ffn_hidden_size / lay.etp
    n_dense = round(m.num_dense_layers * share) if m.num_experts else layers_here
    n_moe = layers_here - n_dense
    per_token = n_dense * (attn + scores + dense_mlp) + n_moe * (attn + scores + moe_mlp)
    biggest_layer = attn + scores + max(dense_mlp if n_dense else 0, moe_mlp if n_moe else 0)
    if t.recompute_granularity == "full":
        group = t.recompute_num_layers or 1
        stored = unsplit(h) * math.ceil(layers_here / group) + group * biggest_layer
        how = f"full recompute: each group of {group} layer(s) keeps its input, one group at a time is rebuilt"
    else:
        stored = per_token
        how = "every layer's activations stored" + ("" if flash else " incl. attention probabilities (no flash kernel)")
    in_flight = lay.pp
    activations = tokens * stored * act_bytes * in_flight
    # megatron keeps each TP rank's vocabulary slice of the logits (the softmax runs over the TP group).
    vocab_here = m.vocab_size / (lay.tp if backend == "megatron" else 1)
    logits = tokens * vocab_here * (4 + 4) if lay.pp == 1 else 0
    details.append(
        f"activations: {tokens} tokens per micro-batch ({tokens_text}); {how}"
        + (f"; × {in_flight} micro-batches in flight (PP {lay.pp})" if in_flight > 1 else "")
        + ((f"; logits and log-softmax in fp32 over the full vocabulary ({m.vocab_size})" if lay.tp == 1
            else f"; logits and log-softmax in fp32 over this TP rank's vocabulary slice ({m.vocab_size} / TP {lay.tp})")
           if logits else "")
    )
    gradients = n_params * g_bytes
    if cfg.lora.enabled:  # the frozen base has no gradients or Adam state; the adapters do (fp32)
        adapters = lora_parameters(cfg, m) * share
        n_params += adapters
        gradients, optimizer = adapters * 4, 0 if o.optimizer_cpu_offload else adapters * 8
        details.append(f"LoRA: {adapters / 1e6:.2f}M adapter parameters train (rank {cfg.lora.lora_rank}); gradients and Adam for them only")
    out = {"parameters": int(n_params * p_bytes), "gradients": int(gradients), "optimizer state": int(optimizer)}
    out.update(_compute_copies(cfg, m, lay, details))
    out.update(_beside_the_actor(cfg, m, lay, details, teacher))
    out["activations"] = int(activations)
    if logits:
        out["logits"] = int(logits)
    out["CUDA context"] = CUDA_CONTEXT
    return out


def _beside_the_actor(cfg, m: ModelSize, lay: _Layout, details: list[str], teacher: ModelSize | None) -> dict[str, int]:
    """The other models on the actor's GPUs, each with the actor's layout (the trainers build them so):
    - the KL reference (--use-kl-loss or --kl-coef != 0): frozen parameters only (with LoRA the
      reference is the base with its adapters off: nothing extra);
    - the OPD teacher (--use-opd --opd-type megatron): frozen parameters only, of the teacher's own
      size (`teacher`, from its config.json; the student's when it is not readable);
    - the PPO critic (--advantage-estimator ppo): a second trained model (the policy without its LM head,
      plus a hidden -> 1 value head) with its own gradients, Adam state and compute copies. Without
      --offload-train it stays on the device while the actor trains; with it, the two take turns (the
      critic trains first, then goes to the host), and the critic, smaller than the actor, is not counted.
    Their activations are never live at once with the actor's (each forward runs alone), so none are added."""
    backend = cfg.train.train_backend
    out = {}
    a = cfg.algo
    if (a.use_kl_loss or a.kl_coef != 0) and not cfg.lora.enabled:
        out["reference model"] = int(sum(_params_here(m, lay, backend)) * _param_bytes(cfg))
        details.append(f"reference model (KL): frozen parameters × {_param_bytes(cfg)} bytes with the actor's layout")
    o = cfg.opd
    if o.use_opd and o.opd_type == "megatron":
        size = teacher or m
        out["OPD teacher"] = int(sum(_params_here(size, lay, backend)) * _param_bytes(cfg))
        details.append(f"OPD teacher: {size.total / 1e9:.2f}B frozen parameters × {_param_bytes(cfg)} bytes with the actor's layout"
                       + ("" if teacher else " (its config.json unread: counted at the student's size)"))
    if a.advantage_estimator == "ppo":
        if cfg.cluster.offload_train:
            details.append("PPO critic: takes turns with the actor on the device (--offload-train), not counted beside it")
        else:
            critic = dataclasses.replace(m, output_head=0, final_norm=m.final_norm + m.hidden_size + 1)  # value head by the norm
            n, p_bytes, g_bytes, _, _, optimizer = _trained_state(cfg, *_params_here(critic, lay, backend), lay)
            copies = _compute_copies(cfg, critic, lay, [])
            out["PPO critic"] = int(n * p_bytes + n * g_bytes + optimizer + sum(copies.values()))
            details.append("PPO critic: the policy without its LM head plus a value head, trained beside it (no --offload-train): "
                           "parameters, gradients, Adam state" + (" and " + ", ".join(copies) if copies else ""))
    return out


def _compute_copies(cfg, m: ModelSize, lay: _Layout, details: list[str]) -> dict[str, int]:
    """What the torch backend holds besides parameters, gradients and Adam while a micro-batch runs:
    - one worker / DDP with --bf16: autocast's cache of bf16 casts of every weight (2 B/param), kept for
      the whole autocast region, which spans the micro-batch's forward and backward;
    - DDP (> 1 worker): its gradient buckets, a second fp32 copy of every gradient (4 B/param;
      `gradient_as_bucket_view` is off);
    - fsdp: the all-gathered (unsharded) weights of the root unit (embedding, final norm, head) and of
      two decoder layers (the one computing and the one prefetched), in the compute dtype."""
    t = cfg.train
    if t.train_backend == "megatron":
        return {}
    out = {}
    if t.train_backend == "torch":
        if t.bf16:
            out["bf16 weight copies"] = m.total * 2
            details.append("bf16 weight copies: autocast caches a bf16 cast of every fp32 weight for each micro-batch's forward and backward (2 bytes/param)")
        if lay.world > 1:
            out["DDP gradient buckets"] = m.total * 4
            details.append("DDP gradient buckets: a flat fp32 copy of every gradient for the all-reduce (4 bytes/param)")
    else:
        unsharded = m.embedding + m.output_head + m.final_norm + 2 * (m.layer_total + m.routed_expert_total) / m.num_layers
        dtype_bytes = 2 if t.bf16 else 4
        out["gathered weights"] = int(unsharded * dtype_bytes)
        details.append(f"gathered weights: FSDP all-gathers the root unit (embedding, norm, head) and two layers at a time, "
                       f"{'bf16' if t.bf16 else 'fp32'} ({dtype_bytes} bytes/param)")
    return out


def _engine(cfg, m: ModelSize, capacity: int | None, details: list[str], problems: list[str]) -> dict[str, int]:
    c = cfg.cluster
    if cfg.rollout.rollout_backend != "sglang":
        return {}
    fraction = cfg.sglang.sglang_mem_fraction_static if hasattr(cfg.sglang, "sglang_mem_fraction_static") else None
    engine_tp = c.rollout_num_gpus_per_engine
    weights = int(m.total * m.weight_bytes / engine_tp)
    # KV heads split over the engine's TP ranks (a head is replicated when there are more ranks than heads);
    # MLA's latent is cached whole on every rank.
    kv_split = min(engine_tp, m.num_kv_heads) if m.num_kv_heads else 1
    kv_per_token = m.kv_elements_per_token * 2 / kv_split
    longest, _ = _longest_sample(cfg)
    out = {"weights": weights}
    if capacity is None or fraction is None:
        if fraction is None:
            details.append("engine share: --sglang-mem-fraction-static unset (SGLang picks it); not checked")
        return out
    share = int(fraction * capacity)
    kv_room = share - weights
    out["KV cache"] = max(0, kv_room)
    sequences = kv_room / (kv_per_token * longest) if kv_room > 0 else 0
    details.append(
        f"engine: --sglang-mem-fraction-static {fraction} × {gib(capacity)} = {gib(share)}; weights {m.total / 1e9:.1f}B × "
        f"{m.weight_bytes:g} bytes / {engine_tp} GPU(s); KV {kv_per_token / 1024:.1f} KiB per token → room for "
        f"{sequences:.0f} sequences of {longest} tokens per engine GPU"
    )
    if kv_room <= 0:
        problems.append(f"the engine's weights ({gib(weights)}) exceed its share of the GPU ({gib(share)})")
    elif sequences < 1:
        problems.append(f"the engine's KV cache ({gib(kv_room)}) cannot hold one sequence of {longest} tokens")
    return out


def plan_memory(cfg, size: ModelSize, hardware: str | None, *, suggest: bool = True, teacher: ModelSize | None = None) -> MemoryPlan:
    """`teacher`: the --opd-type megatron teacher's size (None: counted as the student's)."""
    lay = _layout(cfg)
    capacity = HARDWARE_MEMORY.get(hardware or "")
    details: list[str] = []
    problems: list[str] = []
    trainer = _trainer(cfg, size, lay, details, teacher)
    engine = _engine(cfg, size, capacity, details, problems)
    c = cfg.cluster
    layout = (f"{cfg.train.train_backend}: TP{lay.tp} PP{lay.pp} CP{lay.cp} EP{lay.ep} ETP{lay.etp} DP{lay.dp}"
              if cfg.train.train_backend == "megatron" else f"{cfg.train.train_backend}: DP{lay.world}")
    plan = MemoryPlan(hardware if capacity else None, capacity, layout, trainer, engine, details, problems)
    if capacity is None:
        return plan
    margin = cfg.train.train_memory_margin_bytes
    total = plan.trainer_total
    if c.colocate and c.offload_rollout:
        need, what = total + margin, f"trainer {gib(total)} + --train-memory-margin-bytes {gib(margin)}"
    elif c.colocate:
        engine_share = int((getattr(cfg.sglang, "sglang_mem_fraction_static", None) or 0) * capacity)
        need, what = total + engine_share, f"trainer {gib(total)} + the engine's resident share {gib(engine_share)} (no --offload-rollout)"
    else:
        need, what = total, f"trainer {gib(total)}"
    if need > capacity:
        plan.problems.insert(0, f"{what} = {gib(need)} > {gib(capacity)}")
    if plan.problems and suggest:
        plan.fixes = _fixes(cfg, size, hardware, teacher)
    return plan


def _variants(cfg, size: ModelSize):
    """(description, changed config) candidates, each one change away from `cfg` (expert parallelism
    only for a model with experts: the trainer refuses it on a dense one)."""
    t, c = cfg.train, cfg.cluster
    world = c.actor_num_nodes * c.actor_num_gpus_per_node

    def with_(desc, **changes):
        new = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train), optimizer=dataclasses.replace(cfg.optimizer),
                                  cluster=dataclasses.replace(cfg.cluster))
        for k, v in changes.items():
            new.set(k, v)
        return desc, new

    out = []
    if t.train_backend != "megatron":
        out.append(with_("--train-backend megatron --tensor-model-parallel-size 8 --use-distributed-optimizer --bf16",
                         train_backend="megatron", tensor_model_parallel_size=min(8, world), use_distributed_optimizer=True, bf16=True))
        if t.train_backend == "torch":
            out.append(with_("--train-backend fsdp", train_backend="fsdp"))
            out.append(with_("--train-backend fsdp --bf16", train_backend="fsdp", bf16=True))
    if not t.bf16:
        out.append(with_("--bf16", bf16=True))
    if t.train_backend == "megatron":
        if not t.use_distributed_optimizer:
            out.append(with_("--use-distributed-optimizer", use_distributed_optimizer=True))
        if not cfg.optimizer.optimizer_cpu_offload:
            out.append(with_("--optimizer-cpu-offload", optimizer_cpu_offload=True))
        if t.recompute_granularity != "full":
            out.append(with_("--recompute-granularity full --recompute-method uniform --recompute-num-layers 1",
                             recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1))
        for name, flag in (("tensor_model_parallel_size", "--tensor-model-parallel-size"),
                           ("pipeline_model_parallel_size", "--pipeline-model-parallel-size"),
                           ("expert_model_parallel_size", "--expert-model-parallel-size")):
            doubled = cfg.get(name) * 2
            mp = t.tensor_model_parallel_size * t.pipeline_model_parallel_size * t.context_parallel_size
            if name != "expert_model_parallel_size" and world % (mp * 2):
                continue
            if name == "expert_model_parallel_size" and (world % doubled or not size.num_experts or size.num_experts % doubled):
                continue
            out.append(with_(f"{flag} {doubled}", **{name: doubled}))
    if t.use_dynamic_batch_size and t.max_tokens_per_gpu and t.max_tokens_per_gpu > 1024:
        out.append(with_(f"--max-tokens-per-gpu {t.max_tokens_per_gpu // 2}", max_tokens_per_gpu=t.max_tokens_per_gpu // 2))
    return out


def _fixes(cfg, size: ModelSize, hardware: str | None, teacher: ModelSize | None) -> list[str]:
    fixes = []
    variants = _variants(cfg, size)
    for desc, variant in variants:
        if plan_memory(variant, size, hardware, suggest=False, teacher=teacher).fits:
            fixes.append(desc)
    for bigger in ("H200", "B200", "GB200"):
        if HARDWARE_MEMORY[bigger] > HARDWARE_MEMORY.get(hardware or "", 0) and plan_memory(cfg, size, bigger, suggest=False, teacher=teacher).fits:
            fixes.append(f"--hardware {bigger}")
            break
    if fixes:
        return fixes
    # No single change is enough: apply them one after another (each on top of the last) until one fits.
    current, applied = cfg, {}  # first flag of a change -> the change (a later doubling replaces an earlier one)
    for _ in range(8):
        steps = [(d, v) for d, v in _variants(current, size) if d not in applied.values()]
        if not steps:
            break
        desc, current = min(steps, key=lambda dv: plan_memory(dv[1], size, hardware, suggest=False, teacher=teacher).trainer_total)
        applied[desc.split()[0]] = desc
        if plan_memory(current, size, hardware, suggest=False, teacher=teacher).fits:
            return [" ".join(applied.values()) + " together"]
    return ["no combination of " + ", ".join(d for d, _ in variants) + " is enough; add GPUs (--num-nodes)"]
