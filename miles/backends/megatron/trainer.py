"""`MegatronTrainer`: the megatron-core training backend (one rank of TP x PP x CP x DP), a `TrainerBackend`.

What one rank holds: its piece of a `GPTModel` built from the recipe's HF `config.json` (model.py),
wrapped in megatron-core's `DistributedDataParallel`, and the optimizer from `get_megatron_optimizer`
(Adam with fp32 state; `--use-distributed-optimizer` shards it over DP). `--bf16` is megatron-core's
own mixed precision: bf16 parameters in a `Float16Module`, gradients accumulated and reduced in fp32
(`grad_reduce_in_fp32`), and an optimizer that steps fp32 main copies of the parameters and writes
them back as bf16 (`Float16OptimizerWithFloat16Params`, or the distributed optimizer's fp32 shards). Every forward goes through
megatron-core's own schedule (`get_forward_backward_func`: no pipelining, or 1F1B over PP stages),
on packed micro-batches (forward.py). On a machine without CUDA it runs over gloo through the
patches of `miles.ckpt.megatron_compat`.

The RL step (`miles.train.step.train_rollout`) drives it through the `TrainerBackend` primitives:
`forward` (old/reference log-probs: one forward-only schedule over all micro-batches),
`forward_backward` of one step's micro-batches with the loss it is given (megatron's gradient
all-reduce, `finalize_model_grads`, included), and `optimizer_step(lr)` (clip, Adam). Each
micro-batch's loss is normalised by the whole global batch, so the accumulated gradient is the
gradient of the global batch's mean loss however the batch is cut; megatron divides each loss by the
micro-batch count and the DP size (it averages), which `forward_backward` undoes.

Checkpoints (`save_checkpoint` / `load_checkpoint`, collective): model + optimizer through
`dist_checkpointing` (torch_dist; each rank writes its own shards), and per rank a small file with
the RNG states and the step counter. See checkpoint.py for the distributed-optimizer workarounds.

`role="critic"` builds PPO's critic: the same GPTModel loaded from `--critic-load`, whose last-stage
`output_layer` is then replaced by a scalar value head (`model.ValueHead`, untied from the embedding),
so `values()` and the value loss run through the same schedule; it never sends weights to engines.

Use: `MegatronTrainer(cfg, rank=r, world_size=w, device="cpu")` after `torch.distributed` is up.
"""

from __future__ import annotations

import math
from functools import partial
from pathlib import Path
from typing import Any, Iterator, Literal

import torch
import torch.distributed as dist

from miles.backends.base import LossFn, PackedBatch, TrainerBackend
from miles.backends.collectives import all_reduce_, group_device, reduce_floats
from miles.backends.megatron import model as mm
from miles.backends.precision import engine_dtype
from miles.backends.megatron.forward import StreamInputs, cheaper_layout, response_log_probs, stream_inputs
from miles.backends.megatron.parallel import check_hardware, check_layout, check_model, init_parallel, options_from_config
from miles.errors import UserError


class MegatronTrainer(TrainerBackend):
    """The megatron-core backend; see the module docstring."""

    def __init__(self, cfg, *, rank: int, world_size: int, device: str, init_checkpoint: str | None = None,
                 role: Literal["actor", "critic"] = "actor"):
        from miles.ckpt.megatron_compat import (ensure_alltoall_dispatcher_without_cuda, ensure_cpu_compat,
                                               ensure_moe_router_without_te, quiet_megatron_import)

        self.cfg, self.rank, self.world_size, self.device, self.role = cfg, rank, world_size, device, role
        check_layout(cfg, world_size)
        check_hardware(cfg, cuda=device == "cuda")
        self.shape = mm.read_hf_config(cfg.rollout.hf_checkpoint)
        self.opts = options_from_config(cfg)
        self.layout: Literal["packed", "padded"] | None = None
        """How micro-batches meet the attention kernel (forward.py); None: the cheaper one per micro-batch."""
        check_model(self.shape, self.opts)
        if cfg.train.train_backend != "megatron":
            raise ValueError("MegatronTrainer built for a config with --train-backend torch")
        with quiet_megatron_import():
            ensure_cpu_compat()
            ensure_moe_router_without_te()
            ensure_alltoall_dispatcher_without_cuda()
            from megatron.core import parallel_state as ps
            from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
            from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        init_parallel(self.opts, rank=rank, world_size=world_size, device=device, seed=cfg.optimizer.seed)
        self.ps = ps
        torch.manual_seed(cfg.optimizer.seed)
        if cfg.train.deterministic_mode:
            torch.use_deterministic_algorithms(True)

        source = init_checkpoint or (cfg.critic.critic_load if role == "critic" else cfg.rollout.hf_checkpoint)
        module = mm.build_model(self.shape, self.opts)
        mm.load_weights(module, source, self.shape)
        if role == "critic":
            # Before DDP and the optimizer, which must see its parameters.
            mm.attach_value_head(module, self.shape, cfg.optimizer.seed)
        # Built and loaded on the CPU (use_cpu_initialization), as megatron's own get_model does, then
        # moved: DDP allocates its gradient buffers on the device the parameters are on.
        module.to(device)
        self.config = module.config
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=cfg.train.use_distributed_optimizer)
        self.model = DistributedDataParallel(config=self.config, ddp_config=ddp_config, module=module)
        o = cfg.optimizer
        if o.optimizer != "adam":
            raise UserError(f"--optimizer {o.optimizer!r} is not available; use adam.", option="--optimizer")
        self.optimizer = get_megatron_optimizer(
            OptimizerConfig(optimizer="adam", lr=o.lr, min_lr=o.min_lr, weight_decay=o.weight_decay, adam_beta1=o.adam_beta1,
                            adam_beta2=o.adam_beta2, adam_eps=o.adam_eps, clip_grad=o.clip_grad, bf16=self.opts.bf16, fp16=False,
                            params_dtype=mm.param_dtype(self.opts), use_distributed_optimizer=cfg.train.use_distributed_optimizer),
            [self.model])
        self.config.finalize_model_grads_func = finalize_model_grads
        self.config.no_sync_func = self.model.no_sync
        self.config.grad_scale_func = self.optimizer.scale_loss
        self.ref_model = None
        if self.uses_reference:
            self.ref_model = mm.build_model(self.shape, self.opts)
            mm.load_weights(self.ref_model, cfg.ckpt.ref_load or source, self.shape)
            self.ref_model.to(device).eval().requires_grad_(False)
        self.teacher_model = None
        """`--use-opd --opd-type megatron`: the distillation teacher, built with the student's layout and
        loaded from --opd-teacher-load (an HF directory or torch_dist checkpoint of the student's
        architecture); frozen, outside DDP and the optimizer, never saved."""
        o = cfg.opd
        if role == "actor" and o.use_opd and o.opd_type == "megatron":
            teacher_shape = mm.read_hf_config(o.opd_teacher_load) if (Path(o.opd_teacher_load) / "config.json").is_file() else self.shape
            if teacher_shape != self.shape:
                raise UserError(
                    f"--opd-teacher-load {o.opd_teacher_load} is a {teacher_shape.architecture} of another shape than the student "
                    "(--hf-checkpoint); the megatron trainer builds the teacher with the student's layout, so give a teacher of the "
                    "student's architecture and sizes (or use --train-backend torch, which loads any causal LM).",
                    option="--opd-teacher-load",
                )
            self.teacher_model = mm.build_model(self.shape, self.opts)
            mm.load_weights(self.teacher_model, o.opd_teacher_load, self.shape)
            self.teacher_model.to(device).eval().requires_grad_(False)
        from miles.backends.offload import HostStash

        self._stash = HostStash()  # what offload() took off the device until onload()
        self.num_steps = 0  # optimizer steps taken: the LR schedule's whole state
        self.is_weight_source = dist.get_rank() == 0 and role == "actor"
        self.sync_dtype = engine_dtype(cfg)
        """The dtype the engines hold their weights in: weights are cast to it before they travel."""

    # ----------------------------------------------------------------------------------------------
    @property
    def uses_reference(self) -> bool:
        a = self.cfg.algo
        return self.role == "actor" and (a.use_kl_loss or a.kl_coef != 0)

    @property
    def has_reference(self) -> bool:
        return self.ref_model is not None

    @property
    def has_teacher(self) -> bool:
        return self.teacher_model is not None

    @property
    def dp_rank(self) -> int:
        return self.ps.get_data_parallel_rank()

    @property
    def dp_size(self) -> int:
        return self.ps.get_data_parallel_world_size()

    def all_reduce_dp(self, t: torch.Tensor) -> torch.Tensor:
        return all_reduce_(t, group=self.ps.get_data_parallel_group())

    @property
    def temperature(self) -> float:
        return float(self.cfg.rollout.rollout_temperature)

    def _pad_multiple(self) -> int:
        return self.opts.tensor_model_parallel_size

    # ----------------------------------------------------------------------------------------------
    def _run(self, net, batches: list[PackedBatch], *, forward_only: bool, with_entropy: bool,
             loss_fn=None) -> list[dict[str, Any]]:
        """megatron's schedule over packed micro-batches; the per-micro-batch dicts of the last PP stage."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        # TransformerEngine's causal mask type ignores a mask: packed micro-batches go with PackedSeqParams
        # (its default), padded rows (right padding, never seen by a real token) need none.
        te = self.opts.transformer_impl == "transformer_engine"
        items = [(b, stream_inputs(b, pad_multiple=self._pad_multiple(),
                                   layout=self.layout or ("packed" if te else cheaper_layout(b, self.shape.hidden_size))))
                 for b in batches]
        vocab, temperature = self.shape.vocab_size, self.temperature
        # TP > 1: the output layer hands each rank its vocabulary slice (parallel_output=True).
        tp_group = self.ps.get_tensor_model_parallel_group() if self.opts.tensor_model_parallel_size > 1 else None

        def on_output(batch: PackedBatch, inputs: StreamInputs, output: torch.Tensor):
            if self.role == "critic":  # output [b, s, 1]: the value head's, read at the log-prob positions
                values = output[0 if inputs.seqs is None else inputs.seqs, inputs.rows, 0].float()
                if loss_fn is None:
                    return output.sum() * 0.0, {"values": values.detach()}
                return loss_fn(batch, values, None)
            lp, ent = response_log_probs(output, inputs, vocab_size=vocab, temperature=temperature, with_entropy=with_entropy,
                                         tp_group=tp_group)
            if loss_fn is None:
                return output.sum() * 0.0, {"log_probs": lp.detach(), "entropy": None if ent is None else ent.detach()}
            return loss_fn(batch, lp, ent)

        def forward_step(data_iterator, model):
            batch, inputs = next(data_iterator)
            if te and inputs.cu_seqlens is not None:
                out = model(inputs.input_ids, inputs.position_ids, None, packed_seq_params=inputs.packed_seq_params())
            else:
                out = model(inputs.input_ids, inputs.position_ids, inputs.attention_mask)
            return out, partial(on_output, batch, inputs)

        longest = max(int(i.input_ids.shape[1]) for _, i in items)
        widest = max(int(i.input_ids.shape[0]) for _, i in items)
        return get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter(items), model=[net], num_microbatches=len(items),
            seq_length=longest, micro_batch_size=widest, forward_only=forward_only)

    def _broadcast_from_last_stage(self, tensors: list[torch.Tensor | None], sizes: list[int]) -> list[torch.Tensor]:
        """Every PP stage gets the last stage's per-micro-batch [R_i] results."""
        ps = self.ps
        if ps.get_pipeline_model_parallel_world_size() == 1:
            return tensors  # type: ignore[return-value]
        group = ps.get_pipeline_model_parallel_group()
        src = dist.get_global_rank(group, ps.get_pipeline_model_parallel_world_size() - 1)
        device = group_device(group)  # NCCL: the receive buffer must be a CUDA tensor too
        flat = torch.cat(tensors).to(device) if ps.is_pipeline_last_stage() else torch.empty(sum(sizes), device=device)
        dist.broadcast(flat, src=src, group=group)
        return list(flat.split(sizes))

    def _log_probs(self, batches: list[PackedBatch], *, model: str, with_entropy: bool):
        net = {"actor": self.model, "ref": self.ref_model, "teacher": self.teacher_model}[model]
        if net is None and model == "teacher":
            raise RuntimeError("no teacher is loaded: it is loaded only with --use-opd --opd-type megatron")
        if net is None:
            raise RuntimeError("no reference model is loaded: it is loaded only when --use-kl-loss or --kl-coef is set")
        net.eval()
        with torch.no_grad():
            out = self._run(net, batches, forward_only=True, with_entropy=with_entropy)
        sizes = [int(b.response_lengths.sum()) for b in batches]
        lps = self._broadcast_from_last_stage([o["log_probs"] for o in out] if out else [None] * len(batches), sizes)
        ents = None
        if with_entropy:
            ents = self._broadcast_from_last_stage([o["entropy"] for o in out] if out else [None] * len(batches), sizes)
        return lps, ents

    def values(self, batches: list[PackedBatch]) -> list[torch.Tensor]:
        """The critic's values: one forward-only schedule; every PP stage gets the last stage's."""
        if self.role != "critic":
            return super().values(batches)
        self.model.eval()
        with torch.no_grad():
            out = self._run(self.model, batches, forward_only=True, with_entropy=False)
        sizes = [int(b.response_lengths.sum()) for b in batches]
        return self._broadcast_from_last_stage([o["values"] for o in out] if out else [None] * len(batches), sizes)

    def forward(self, batches: list[PackedBatch], *, model: Literal["actor", "ref", "teacher"] = "actor",
                with_entropy: bool = False) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """One forward-only schedule over all `batches`; every PP stage gets the last stage's results."""
        if self.role == "critic":
            raise RuntimeError("the critic has no log-probs; call values()")
        lps, ents = self._log_probs(batches, model=model, with_entropy=with_entropy)
        return list(zip(lps, ents if ents is not None else [None] * len(lps)))

    # ----------------------------------------------------------------------------------------------
    def forward_backward(self, batches: list[PackedBatch], loss_fn: LossFn, *, with_entropy: bool, entropy_grad: bool) -> None:
        # megatron's schedule divides each micro-batch loss by their count and DDP averages over DP;
        # our losses are already normalised by the global batch, so undo both.
        scale = len(batches) * self.ps.get_data_parallel_world_size()

        def scaled(batch: PackedBatch, lp: torch.Tensor, ent: torch.Tensor | None):
            if ent is not None and not entropy_grad:
                ent = ent.detach()
            return loss_fn(batch, lp, ent) * scale, {}

        self.model.train()
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        self._run(self.model, batches, forward_only=False, with_entropy=with_entropy, loss_fn=scaled)

    @property
    def num_optimizer_steps(self) -> int:
        return self.num_steps

    def optimizer_step(self, lr: float) -> tuple[float, bool]:
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        ok, grad_norm, _ = self.optimizer.step()
        grad_norm = float(grad_norm) if grad_norm is not None else 0.0
        if ok and math.isfinite(grad_norm):
            self.num_steps += 1
            return grad_norm, True
        return grad_norm, False

    def all_reduce_metrics(self, local: dict[str, float]) -> dict[str, float]:
        return self._reduce_metrics(local)

    def _reduce_metrics(self, local: dict[str, float]) -> dict[str, float]:
        """Sum (max/min) over DP ranks of the last stage, then hand the result to every PP stage."""
        ps = self.ps
        keys = sorted(local) if ps.is_pipeline_last_stage() else []
        # Stages other than the last have no metrics; the key list travels with the values.
        obj = [keys if keys else None]
        if ps.get_pipeline_model_parallel_world_size() > 1:
            group = ps.get_pipeline_model_parallel_group()
            dist.broadcast_object_list(obj, src=dist.get_global_rank(group, ps.get_pipeline_model_parallel_world_size() - 1), group=group)
        keys = obj[0] or []
        values = [local.get(k, 0.0) for k in keys]
        if ps.is_pipeline_last_stage() and ps.get_data_parallel_world_size() > 1:
            group = ps.get_data_parallel_group()
            for op, pick in ((dist.ReduceOp.SUM, lambda k: not k.endswith(("_max", "_min"))),
                             (dist.ReduceOp.MAX, lambda k: k.endswith("_max")), (dist.ReduceOp.MIN, lambda k: k.endswith("_min"))):
                idx = [i for i, k in enumerate(keys) if pick(k)]
                if idx:  # reduce_floats: on the group's device (NCCL refuses CPU tensors)
                    for i, v in zip(idx, reduce_floats([values[i] for i in idx], op=op, group=group)):
                        values[i] = v
        if ps.get_pipeline_model_parallel_world_size() > 1 and keys:
            group = ps.get_pipeline_model_parallel_group()
            packed = torch.tensor(values, dtype=torch.float64, device=group_device(group))
            dist.broadcast(packed, src=dist.get_global_rank(group, ps.get_pipeline_model_parallel_world_size() - 1), group=group)
            values = packed.tolist()
        return dict(zip(keys, values))

    # ----------------------------------------------------------------------------------------------
    def offload(self) -> None:
        """--offload-train: parameters (actor and reference), gradient buffers and optimizer state (fp32
        main parameters, Adam moments) leave the GPU (nothing to do on CPU). See `offload_to_host`."""
        if self.device != "cpu":
            self.offload_to_host(self.device)

    def onload(self) -> None:
        if self._stash.offloaded:
            self._stash.restore()

    def offload_to_host(self, device: str) -> int:
        """Release every storage on `device` this trainer holds (miles/backends/offload.py: copied to
        host and shrunk in place, so megatron's buffer views survive; gradients dropped and zeroed on
        return); the bytes released. Public for the CPU tests, which run it with device="cpu"."""
        from miles.backends.megatron.checkpoint import _inner_optimizers

        keep: list[torch.Tensor] = list(self.model.parameters())
        for frozen in (self.ref_model, self.teacher_model):
            if frozen is not None:
                keep += list(frozen.parameters())
        grads: list[torch.Tensor] = [b.grad_data for b in self.model.buffers + self.model.expert_parallel_buffers]
        for opt in _inner_optimizers(self):
            inner = opt.optimizer
            for group in inner.param_groups:
                keep += group["params"]  # the fp32 main copies under --bf16 / the distributed optimizer
                grads += [p.grad for p in group["params"] if p.grad is not None]
            keep += [v for st in inner.state.values() for v in st.values() if torch.is_tensor(v)]
        return self._stash.offload(keep, device, discard=grads)

    # ----------------------------------------------------------------------------------------------
    def save_checkpoint(self, directory: str) -> None:
        from miles.backends.megatron.checkpoint import save

        save(self, Path(directory))

    def load_checkpoint(self, directory: str) -> None:
        from miles.backends.megatron.checkpoint import load

        load(self, Path(directory))

    # ----------------------------------------------------------------------------------------------
    def iter_hf_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Collective: (HF name, full tensor in the engines' dtype) for every weight, in the rule tables' order."""
        from miles.ckpt.convert.mapping import megatron_to_hf, rules_for

        rules = {r.megatron: r for r in rules_for(self.shape)}
        for name, full in mm.iter_full_megatron_tensors(self.model, self.shape):
            yield from ((n, t.to(self.sync_dtype)) for n, t in zip(rules[name].hf, megatron_to_hf(rules[name], full, self.shape)))

    def iter_weight_buckets(self, bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Collective. Bucket boundaries come from the HF shapes in the config, so every rank plans the
        same buckets without talking; only the weight source keeps the tensors."""
        from miles.ckpt.convert.layout import hf_shapes
        from miles.ckpt.convert.mapping import megatron_to_hf, rules_for

        if bucket_bytes <= 0:
            raise ValueError(f"bucket size must be positive (--update-weight-buffer-size), got {bucket_bytes}")
        shapes = hf_shapes(self.shape)
        rules = rules_for(self.shape)
        groups: list[list] = [[]]
        size = 0
        for r in rules:
            nbytes = sum(math.prod(shapes[n]) * self.sync_dtype.itemsize for n in r.hf)
            if groups[-1] and size + nbytes > bucket_bytes:
                groups.append([])
                size = 0
            groups[-1].append(r)
            size += nbytes
        for group in groups:
            bucket: list[tuple[str, torch.Tensor]] = []
            for name, full in mm.iter_full_megatron_tensors(self.model, self.shape, group):
                rule = next(r for r in group if r.megatron == name)
                if self.is_weight_source:
                    bucket.extend((n, t.to(self.sync_dtype)) for n, t in zip(rule.hf, megatron_to_hf(rule, full.clone(), self.shape)))
            yield bucket

    def weights_checksum(self) -> str:
        from miles.utils.weights import weights_checksum

        digest = weights_checksum(self.iter_hf_weights())
        obj = [digest]
        dist.broadcast_object_list(obj, src=0)
        return obj[0]
