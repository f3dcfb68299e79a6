"""`TorchBackend`: the torch implementation of `TrainerBackend` (a HF causal LM, AdamW, DDP or FSDP2 over gloo/NCCL).

It implements the compute primitives the RL step (`miles.train.step.train_rollout`) drives: no-grad
forwards of the actor and of the frozen reference model (loaded when a KL term is on: `--use-kl-loss`
or `--kl-coef`), forward-backward of one step's micro-batches with the loss it is given, and an
AdamW step at the lr it is given (clip first; a non-finite gradient norm skips the step). With DP the
model runs under torch's `DistributedDataParallel`, whose gradient all-reduce (a sum, by a comm
hook, since the loss is already normalised by the global batch) overlaps the last micro-batch's
backward. With `--train-backend fsdp` the model is sharded by FSDP2 instead
(miles/backends/torch/fsdp.py) and gradients are reduce-scattered, also as a sum, after every
micro-batch.

The caller (`miles.ray.train_group.TrainWorker`) initialises `torch.distributed` (one process per
rank) and passes the same full `train_data` to every rank; each rank trains on its own shard.
Checkpoints are per rank (`save_checkpoint`/`load_checkpoint`, torch.distributed.checkpoint).

`--bf16` (mixed precision; parameters, gradients and AdamW state stay fp32, so the optimizer updates
fp32 master weights): under FSDP2 by its `MixedPrecisionPolicy` (each layer's weights all-gathered
as bf16, gradients reduce-scattered in fp32); under DDP or one worker by `torch.autocast(bfloat16)`
around every forward, which runs matmuls in bf16 from the fp32 parameters (norms, softmax and the
log-probs stay fp32; backward follows the forward's dtypes, so parameter gradients are fp32 and DDP
reduces them in fp32). The log-probs are always computed in fp32 from the (bf16) logits.

`--use-opd --opd-type megatron` loads the distillation teacher (`--opd-teacher-load`) beside the actor
like the reference model: frozen, never given to the optimizer, never saved, offloaded with the actor;
`forward(model="teacher")` gives its log-probs.

`role="critic"` builds PPO's critic instead (miles/backends/torch/value_model.py: the decoder of
`--critic-load` with a scalar value head, no LM head and no reference model): `values()` gives its
per-token values and `forward_backward` hands its loss function values in place of log-probs. A
critic never sends weights to the engines.

Use (in-process or inside a Ray actor):

    trainer = TorchBackend(cfg, rank=0, world_size=1, device="cpu")   # cfg: a resolved EngineConfig
    metrics = miles.train.step.train_rollout(trainer, train_data, rollout_id=0)
    for bucket in trainer.iter_weight_buckets(cfg.rollout.update_weight_buffer_size): ...
"""

from __future__ import annotations

import contextlib
import math
import time
from typing import TYPE_CHECKING, Iterator, Literal

import torch
import torch.distributed as dist

from miles.backends.base import LossFn, PackedBatch, TrainerBackend
from miles.backends.collectives import all_reduce_, reduce_floats
from miles.backends.torch.fsdp import full_tensor
from miles.backends.precision import compute_context, engine_dtype
from miles.backends.torch.forward import ResponseLogits, response_log_probs
from miles.backends.torch.optim import StepCounter, build_optimizer
from miles.backends.torch.rng import seed_everything

if TYPE_CHECKING:
    from miles.config.engine import EngineConfig

def _load_causal_lm(hf_dir: str, device: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    # fp32 weights: the trainer's master copy; eager attention gives the same numbers on every
    # platform (sdpa may pick a different kernel per device).
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager")
    return model.to(device)


def _all_reduce_metrics(local: dict[str, float]) -> dict[str, float]:
    """Combine metrics over DP ranks like `combine_metric` does over micro-batches (same keys on every rank)."""
    out = dict(local)
    for op, pick in (
        (dist.ReduceOp.SUM, lambda k: not k.endswith(("_max", "_min"))),
        (dist.ReduceOp.MAX, lambda k: k.endswith("_max")),
        (dist.ReduceOp.MIN, lambda k: k.endswith("_min")),
    ):
        keys = sorted(k for k in local if pick(k))
        if keys:  # on the group's device: NCCL refuses CPU tensors
            out.update(zip(keys, reduce_floats([local[k] for k in keys], op=op)))
    return out


def _sum_gradients_hook(process_group, bucket):
    """DDP comm hook: sum (not average) gradients over ranks; the loss is already divided by the
    global batch, so the sum is the global batch's gradient, exactly as one process would get it."""
    fut = dist.all_reduce(bucket.buffer(), group=process_group, async_op=True).get_future()
    return fut.then(lambda f: f.value()[0])


class TorchBackend(TrainerBackend):
    """The torch training backend. See the module docstring for the step it runs."""

    def __init__(
        self, cfg: "EngineConfig", *, rank: int = 0, world_size: int = 1, device: str = "cpu", role: Literal["actor", "critic"] = "actor"
    ):
        from miles.algo.losses import get_loss_function

        if world_size > 1:
            if not (dist.is_available() and dist.is_initialized()):
                raise RuntimeError(
                    f"world_size={world_size} needs torch.distributed initialised by the caller "
                    "(one process per rank) before the trainer is built"
                )
            if dist.get_world_size() != world_size or dist.get_rank() != rank:
                raise RuntimeError(
                    f"trainer given rank={rank}/world_size={world_size} but the process group is "
                    f"rank {dist.get_rank()} of {dist.get_world_size()}"
                )
        self.cfg = cfg
        self.algo_cfg = cfg.algo
        self.optimizer_cfg = cfg.optimizer
        self.temperature = cfg.rollout.rollout_temperature
        self.device = device
        self.rank, self.world_size = rank, world_size
        self.role = role
        self.is_weight_source = rank == 0 and role == "actor"
        self.bf16 = cfg.train.bf16
        self.sync_dtype = engine_dtype(cfg)
        """The dtype the engines hold their weights in: weights are cast to it before they travel."""

        seed_everything(cfg.optimizer.seed, deterministic=cfg.train.deterministic_mode)
        self.fsdp = cfg.train.train_backend == "fsdp"
        """FSDP2 (`--train-backend fsdp`): parameters, gradients and AdamW state sharded over the
        ranks (miles/backends/torch/fsdp.py); otherwise every rank holds everything (DDP)."""
        if self.fsdp:
            from miles.backends.torch.fsdp import ensure_process_group

            ensure_process_group(device)
        self.peft = None
        """With LoRA (`--lora-rank`): the PEFT wrapper whose adapters were injected into `self.model` in
        place (miles/backends/torch/lora.py); the base is frozen and the reference is the base itself."""
        if role == "critic":
            from miles.backends.torch.value_model import ValueModel

            self.model = ValueModel.from_pretrained(cfg.critic.critic_load, device, seed=cfg.optimizer.seed)
            self.net = self.model  # already takes the layout's inputs and returns [R] values
        else:
            self.model = _load_causal_lm(cfg.rollout.hf_checkpoint, device)
            if cfg.lora.enabled:
                from miles.backends.torch.lora import attach_lora

                self.peft = attach_lora(self.model, cfg)
            self.net = ResponseLogits(self.model)
            if cfg.train.recompute_granularity == "full":
                # Each decoder layer's activations are recomputed in backward (non-reentrant checkpoint:
                # works under FSDP2 and DDP, and the recomputed forward runs the same kernels).
                self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.model.train()
        self.train_net: torch.nn.Module = self.net
        if self.fsdp:
            from miles.backends.torch.fsdp import shard_response_logits

            shard_response_logits(self.net, device, bf16=self.bf16)  # in place: self.net is the FSDP root
        elif world_size > 1:
            # broadcast_buffers=False: the only buffers are rotary tables, identical on every rank.
            self.train_net = torch.nn.parallel.DistributedDataParallel(self.net, broadcast_buffers=False)
            self.train_net.register_comm_hook(None, _sum_gradients_hook)
        self.ref_model: torch.nn.Module | None = None
        self.ref_net: ResponseLogits | None = None
        if self.uses_reference and self.peft is None:  # LoRA: the reference is the base, adapters off
            self.ref_model = _load_causal_lm(cfg.ckpt.ref_load or cfg.rollout.hf_checkpoint, device)
            self.ref_model.eval().requires_grad_(False)
            self.ref_net = ResponseLogits(self.ref_model)
            if self.fsdp:
                from miles.backends.torch.fsdp import shard_response_logits

                shard_response_logits(self.ref_net, device, bf16=self.bf16)
        self.teacher_net: ResponseLogits | None = None
        opd = cfg.opd
        if role == "actor" and opd.use_opd and opd.opd_type == "megatron":
            teacher = _load_causal_lm(opd.opd_teacher_load, device)
            teacher.eval().requires_grad_(False)
            self.teacher_net = ResponseLogits(teacher)
            if self.fsdp:
                from miles.backends.torch.fsdp import shard_response_logits

                shard_response_logits(self.teacher_net, device, bf16=self.bf16)
        self.optimizer = build_optimizer(self.model, cfg.optimizer)
        # FSDP's policy casts inside the sharded modules; autocast would only cast them again.
        self._compute = lambda: compute_context(device, bf16=self.bf16 and not self.fsdp)
        self.steps = StepCounter()
        # Resolved once here so a bad --custom-loss-function-path fails at start-up, not mid-step.
        get_loss_function(cfg.algo)

    # ----------------------------------------------------------------------------------------------
    @property
    def uses_reference(self) -> bool:
        """A frozen reference model is loaded when a KL term needs its log-probs."""
        return self.role == "actor" and (self.algo_cfg.use_kl_loss or self.algo_cfg.kl_coef != 0)

    @property
    def has_reference(self) -> bool:
        return self.ref_net is not None or (self.peft is not None and self.uses_reference)

    @property
    def has_teacher(self) -> bool:
        return self.teacher_net is not None

    @property
    def dp_rank(self) -> int:
        return self.rank

    @property
    def dp_size(self) -> int:
        return self.world_size

    def all_reduce_dp(self, t: torch.Tensor) -> torch.Tensor:
        return all_reduce_(t)

    def all_reduce_metrics(self, local: dict[str, float]) -> dict[str, float]:
        return _all_reduce_metrics(local) if self.world_size > 1 else local

    # ----------------------------------------------------------------------------------------------
    def forward(
        self, batches: list[PackedBatch], *, model: Literal["actor", "ref", "teacher"] = "actor", with_entropy: bool = False
    ) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """Per batch, log-probs [R] (and entropy [R]) of its response tokens, no grad, at the rollout
        temperature; each batch is one forward."""
        if self.role == "critic":
            raise RuntimeError("the critic has no log-probs; call values()")
        if model == "ref" and not self.has_reference:
            raise RuntimeError("no reference model is loaded: it is loaded only when --use-kl-loss or --kl-coef is set")
        if model == "teacher" and self.teacher_net is None:
            raise RuntimeError("no teacher is loaded: it is loaded only with --use-opd --opd-type megatron")
        base_only = model == "ref" and self.peft is not None
        net = {"actor": self.net, "ref": self.net if base_only else self.ref_net, "teacher": self.teacher_net}[model]
        # No-grad passes score the policy itself: dropout (--lora-dropout) is for the training pass only.
        self.model.eval()
        out = []
        with self._adapters_off() if base_only else contextlib.nullcontext():
            for batch in batches:
                with torch.no_grad(), self._compute():
                    lp, ent = response_log_probs(net, batch, temperature=self.temperature, with_entropy=with_entropy)
                out.append((lp.detach(), None if ent is None else ent.detach()))
        return out

    def values(self, batches: list[PackedBatch]) -> list[torch.Tensor]:
        if self.role != "critic":
            return super().values(batches)
        from miles.backends.torch.value_model import response_values

        with torch.no_grad(), self._compute():
            return [response_values(self.net, b).float().detach() for b in batches]

    def _adapters_off(self):
        from miles.backends.torch.lora import adapters_disabled

        return adapters_disabled(self.peft)

    # ----------------------------------------------------------------------------------------------
    def forward_backward(self, batches: list[PackedBatch], loss_fn: LossFn, *, with_entropy: bool, entropy_grad: bool) -> None:
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        last = len(batches) - 1
        for k, batch in enumerate(batches):
            # DDP: gradients of all but the last micro-batch stay local; it all-reduces on the last
            # backward. FSDP reduce-scatters every micro-batch, so no rank ever holds a full gradient.
            ddp = self.world_size > 1 and not self.fsdp
            sync = self.train_net.no_sync() if ddp and k < last else contextlib.nullcontext()
            with sync, self._compute():
                if self.role == "critic":
                    from miles.backends.torch.value_model import response_values

                    loss_fn(batch, response_values(self.train_net, batch), None).backward()
                    continue
                log_probs, entropy = response_log_probs(
                    self.train_net, batch, temperature=self.temperature, with_entropy=with_entropy, entropy_grad=entropy_grad
                )
                loss_fn(batch, log_probs, entropy).backward()

    @property
    def num_optimizer_steps(self) -> int:
        return self.steps.num_steps

    def optimizer_step(self, lr: float) -> tuple[float, bool]:
        params = [p for p in self.model.parameters() if p.requires_grad]
        max_norm = self.optimizer_cfg.clip_grad if self.optimizer_cfg.clip_grad > 0 else math.inf
        # Under FSDP the gradients are shards (DTensors); clip_grad_norm_ reduces their norms over the
        # ranks, so this is the global norm on every rank, as one process would compute it.
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm))
        if not math.isfinite(grad_norm):
            # A NaN/inf gradient would poison every weight and both Adam moments; drop this step.
            self.optimizer.zero_grad(set_to_none=True)
            return grad_norm, False
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        self.steps.advance()
        return grad_norm, True

    # ----------------------------------------------------------------------------------------------
    def offload(self) -> None:
        """--offload-train: weights and optimizer state to host memory while the engine generates."""
        self._move("cpu")

    def onload(self) -> None:
        self._move(self.device)

    def _move(self, device: str) -> None:
        if self.device == "cpu":
            return  # already in host memory
        # The wrappers, not the HF models: under FSDP they are the roots, whose `.to()` re-points
        # the sharded parameters FSDP keeps (the HF model's own `.to()` would miss the root's).
        for net in (self.net, self.ref_net, self.teacher_net):
            if net is not None:
                net.to(device)
        for state in self.optimizer.state.values():
            for key, value in state.items():
                if torch.is_tensor(value) and value.dim() > 0:
                    state[key] = value.to(device)
        if device == "cpu":
            torch.cuda.empty_cache()

    # ----------------------------------------------------------------------------------------------
    def save_checkpoint(self, directory: str) -> None:
        from miles.backends.torch import checkpoint

        adapter_only = self.peft is not None
        checkpoint.save(directory, model=self.model, optimizer=self.optimizer, scheduler=self.steps, rank=self.rank, adapter_only=adapter_only)
        if adapter_only and self.rank == 0:
            from miles.backends.torch.lora import write_adapter_config

            write_adapter_config(self.peft, directory, self.cfg.rollout.hf_checkpoint)

    def load_checkpoint(self, directory: str) -> None:
        from miles.backends.torch import checkpoint

        checkpoint.load(directory, model=self.model, optimizer=self.optimizer, scheduler=self.steps, rank=self.rank, adapter_only=self.peft is not None)

    # ----------------------------------------------------------------------------------------------
    def named_weights_for_sync(self, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """(Hugging Face checkpoint name, full tensor, cast to `dtype` when given) for every weight, each
        parameter once (a tied lm_head is skipped, as in HF's safetensors); MoE experts that transformers
        fuses in memory are split back per expert (miles/utils/hf_experts.py), as the checkpoint holds them. Unsharded and already of that dtype,
        the tensors are the live weights, detached: copy them before the next `train_step`. Under FSDP each is gathered when the iterator reaches it,
        a collective: every rank must iterate to the end."""
        if self.peft is not None:  # base + adapter under the base's names (miles/backends/torch/lora.py)
            from miles.backends.torch.lora import merged_named_weights

            for name, merged in merged_named_weights(self.model):
                yield name, merged if dtype is None else merged.to(dtype)
            return
        from miles.utils.hf_experts import checkpoint_tensors

        def unique_full() -> Iterator[tuple[str, torch.Tensor]]:
            seen: set[int] = set()
            # keep_vars: the Parameter objects themselves, so a tied weight is one object under two names
            # on every rank (a storage pointer would not do: an empty shard has none).
            for name, tensor in self.model.state_dict(keep_vars=True).items():
                if id(tensor) not in seen:
                    seen.add(id(tensor))
                    yield name, full_tensor(tensor.detach())

        # Checkpoint names, as engines load them: transformers 5 fuses MoE experts in memory.
        for name, full in checkpoint_tensors(unique_full(), getattr(self.model.config, "model_type", None)):
            yield name, full if dtype is None else full.to(dtype)

    def iter_weight_buckets(self, bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """HF-named full weights in the engines' dtype, in buckets of at most `bucket_bytes` (a bigger
        tensor travels alone).

        Every rank plans the same buckets (under FSDP gathering each tensor with the other ranks; under
        DDP every rank already holds it), and ranks other than the weight source yield them empty.
        """
        from miles.utils.weights import iter_weight_buckets

        for bucket in iter_weight_buckets(self.named_weights_for_sync(self.sync_dtype), bucket_bytes):
            yield bucket if self.is_weight_source else []

    def parameter_metrics(self) -> dict[str, float]:
        from miles.backends.torch.lora import parameter_summary

        return parameter_summary(self.model, self.optimizer)

    def weights_checksum(self) -> str:
        from miles.utils.weights import weights_checksum

        return weights_checksum(self.named_weights_for_sync(self.sync_dtype))
