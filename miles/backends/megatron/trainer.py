"""`MegatronTrainer`: the megatron-core training backend (one rank of TP x PP x CP x DP), a `TrainerBackend`.

What one rank holds: its piece of a `GPTModel` built from the recipe's HF `config.json` (model.py),
wrapped in megatron-core's `DistributedDataParallel`, and the optimizer from `get_megatron_optimizer`
(Adam, fp32; `--use-distributed-optimizer` shards its state over DP). Every forward goes through
megatron-core's own schedule (`get_forward_backward_func`: no pipelining, or 1F1B over PP stages),
on packed micro-batches (forward.py). On a machine without CUDA it runs over gloo through the
patches of `miles.ckpt.megatron_compat`.

One `train_step(train_data, rollout_id=...)`, in the torch backend's order: cut the rollout into
`num_steps_per_rollout` optimizer steps of `global_batch_size` samples, this DP rank's share in
micro-batches of `micro_batch_size`; old (and reference) log-probs with a forward-only pass;
advantages; per step: forward/backward of every micro-batch, megatron's gradient all-reduce
(`finalize_model_grads`), clip, Adam step at `lr_at(step)`. Each micro-batch's loss is normalised by
the whole global batch, so the accumulated gradient is the gradient of the global batch's mean loss
however the batch is cut; megatron divides each loss by the micro-batch count and the DP size
(it averages), which `_LOSS_SCALE` undoes.

Checkpoints (`save_checkpoint` / `load_checkpoint`, collective): model + optimizer through
`dist_checkpointing` (torch_dist; each rank writes its own shards), and per rank a small file with
the RNG states and the step counter. See checkpoint.py for the distributed-optimizer workarounds.

Use: `MegatronTrainer(cfg, rank=r, world_size=w, device="cpu")` after `torch.distributed` is up.
"""

from __future__ import annotations

import math
import time
from functools import partial
from pathlib import Path
from typing import Any, Iterator, Literal

import torch
import torch.distributed as dist

from miles.backends.base import PackedBatch, TrainerBackend
from miles.backends.megatron import model as mm
from miles.backends.megatron.forward import StreamInputs, cheaper_layout, response_log_probs, stream_inputs
from miles.backends.megatron.parallel import check_hardware, check_layout, check_model, init_parallel, options_from_config
from miles.backends.loss import combine_metric
from miles.backends.packing import pack_samples
from miles.errors import UserError


def _policy_loss(log_probs: torch.Tensor, entropy: torch.Tensor | None, batch: PackedBatch, cfg, normalizer: float):
    """The shared packed loss (miles/backends/loss.py), the same call the torch backend makes."""
    from miles.backends.loss import packed_loss

    return packed_loss(cfg, log_probs, entropy, batch, normalizer)


class MegatronTrainer(TrainerBackend):
    """The megatron-core backend; see the module docstring."""

    def __init__(self, cfg, *, rank: int, world_size: int, device: str, init_checkpoint: str | None = None):
        from miles.ckpt.megatron_compat import ensure_cpu_compat, quiet_megatron_import

        self.cfg, self.rank, self.world_size, self.device = cfg, rank, world_size, device
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
            from megatron.core import parallel_state as ps
            from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
            from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        init_parallel(self.opts, rank=rank, world_size=world_size, device=device)
        self.ps = ps
        torch.manual_seed(cfg.optimizer.seed)
        if cfg.train.deterministic_mode:
            torch.use_deterministic_algorithms(True)

        source = init_checkpoint or cfg.rollout.hf_checkpoint
        module = mm.build_model(self.shape, self.opts)
        mm.load_weights(module, source, self.shape)
        self.config = module.config
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=cfg.train.use_distributed_optimizer)
        self.model = DistributedDataParallel(config=self.config, ddp_config=ddp_config, module=module)
        o = cfg.optimizer
        if o.optimizer != "adam":
            raise UserError(f"--optimizer {o.optimizer!r} is not available; use adam.", option="--optimizer")
        self.optimizer = get_megatron_optimizer(
            OptimizerConfig(optimizer="adam", lr=o.lr, min_lr=o.min_lr, weight_decay=o.weight_decay, adam_beta1=o.adam_beta1,
                            adam_beta2=o.adam_beta2, adam_eps=o.adam_eps, clip_grad=o.clip_grad, bf16=False, fp16=False,
                            params_dtype=torch.float32, use_distributed_optimizer=cfg.train.use_distributed_optimizer),
            [self.model])
        self.config.finalize_model_grads_func = finalize_model_grads
        self.config.no_sync_func = self.model.no_sync
        self.config.grad_scale_func = self.optimizer.scale_loss
        self.ref_model = None
        if self.uses_reference:
            self.ref_model = mm.build_model(self.shape, self.opts)
            mm.load_weights(self.ref_model, cfg.ckpt.ref_load or source, self.shape)
            self.ref_model.eval().requires_grad_(False)
        self.num_steps = 0  # optimizer steps taken: the LR schedule's whole state
        self.is_weight_source = dist.get_rank() == 0

    # ----------------------------------------------------------------------------------------------
    @property
    def uses_reference(self) -> bool:
        a = self.cfg.algo
        return a.use_kl_loss or a.kl_coef != 0

    @property
    def is_sft(self) -> bool:
        return self.cfg.algo.loss_type == "sft_loss"

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

        items = [(b, stream_inputs(b, pad_multiple=self._pad_multiple(), layout=self.layout or cheaper_layout(b, self.shape.hidden_size)))
                 for b in batches]
        vocab, temperature = self.shape.vocab_size, self.temperature

        def on_output(batch: PackedBatch, inputs: StreamInputs, output: torch.Tensor):
            lp, ent = response_log_probs(output, inputs, vocab_size=vocab, temperature=temperature, with_entropy=with_entropy)
            if loss_fn is None:
                return output.sum() * 0.0, {"log_probs": lp.detach(), "entropy": None if ent is None else ent.detach()}
            return loss_fn(batch, lp, ent)

        def forward_step(data_iterator, model):
            batch, inputs = next(data_iterator)
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
        flat = torch.cat(tensors) if ps.is_pipeline_last_stage() else torch.empty(sum(sizes))
        dist.broadcast(flat, src=src, group=group)
        return list(flat.split(sizes))

    def _log_probs(self, batches: list[PackedBatch], *, model: str, with_entropy: bool):
        net = self.model if model == "actor" else self.ref_model
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

    def compute_log_probs(self, batch: PackedBatch, *, model: Literal["actor", "ref"] = "actor",
                          with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        lps, ents = self._log_probs([batch], model=model, with_entropy=with_entropy)
        return lps[0], (ents[0] if ents is not None else None)

    # ----------------------------------------------------------------------------------------------
    def train_step(self, train_data: dict, *, rollout_id: int) -> dict[str, float]:
        from miles.backends.torch.batching import plan_steps

        t0 = time.perf_counter()
        ps, d = self.ps, self.cfg.data
        dp_rank, dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
        n = len(train_data["tokens"])
        plans = plan_steps(n, global_batch_size=d.global_batch_size, num_steps=d.num_steps_per_rollout or 1,
                           micro_batch_size=self.cfg.train.micro_batch_size, dp_rank=dp_rank, dp_world_size=dp_size)
        batches = [[pack_samples(train_data, mb, self.device) for mb in p.micro_batches] for p in plans]
        if not self.is_sft:
            self._fill_policy_inputs(train_data, plans, batches, rollout_id)
        step_metrics = [self._optimizer_step(train_data, plan, mbs) for plan, mbs in zip(plans, batches)]
        metrics: dict[str, float] = {}
        for key in step_metrics[0]:
            values = [m[key] for m in step_metrics]
            metrics[key] = (values[-1] if key == "train/lr" else max(values) if key.endswith("_max")
                            else min(values) if key.endswith("_min") else sum(values) / len(values))
        elapsed = time.perf_counter() - t0
        tokens = sum(len(train_data["tokens"][i]) for p in plans for i in p.global_indices)
        metrics["perf/train_step_time"] = elapsed
        metrics["perf/train_tokens_per_s"] = tokens / elapsed if elapsed > 0 else 0.0
        return metrics

    def _fill_policy_inputs(self, train_data: dict, plans, batches: list[list[PackedBatch]], rollout_id: int) -> None:
        """Fill old/ref log-probs, advantages and returns of every micro-batch of this rank (one
        vectorised call into miles.algo.advantages over all of them, as the torch backend does).

        No whole-groups requirement: group statistics were taken over whole groups on the rollout side
        and every estimator works per sample, so a DP rank may hold part of a group;
        `--normalize-advantages` whitens with statistics summed over megatron's data-parallel group."""
        from miles.algo.advantages import compute_advantages_and_returns
        from miles.algo.segments import Segments

        a = self.cfg.algo
        flat = [b for mbs in batches for b in mbs]
        local = [i for p in plans for i in p.local_indices]
        if a.use_rollout_logprobs:
            if any(b.rollout_log_probs is None for b in flat):
                raise ValueError("--use-rollout-logprobs is set but the train data has no rollout_log_probs")
            old = [b.rollout_log_probs for b in flat]
        else:
            old, _ = self._log_probs(flat, model="actor", with_entropy=False)
        ref = self._log_probs(flat, model="ref", with_entropy=False)[0] if self.ref_model is not None else None
        for i, b in enumerate(flat):
            b.old_log_probs = old[i]
            if ref is not None:
                b.ref_log_probs = ref[i]
        dp_group = self.ps.get_data_parallel_group() if self.ps.get_data_parallel_world_size() > 1 else None

        def dp_sum(t: torch.Tensor) -> torch.Tensor:
            dist.all_reduce(t, group=dp_group)
            return t

        advantages, returns = compute_advantages_and_returns(
            a,
            rewards=torch.tensor([float(train_data["rewards"][i]) for i in local], dtype=torch.float32, device=self.device),
            loss_mask=torch.cat([b.loss_mask for b in flat]),
            segments=Segments.from_lengths(torch.cat([b.response_lengths for b in flat])),
            n_samples_per_prompt=self.cfg.data.n_samples_per_prompt,
            log_probs=torch.cat(old),
            ref_log_probs=torch.cat(ref) if ref is not None else None,
            all_reduce=dp_sum if dp_group is not None else None,
        )
        sizes = [b.loss_mask.numel() for b in flat]
        for b, adv, ret in zip(flat, advantages.split(sizes), returns.split(sizes)):
            b.advantages, b.returns = adv, ret

    def _optimizer_step(self, train_data: dict, plan, mbs: list[PackedBatch]) -> dict[str, float]:
        from miles.backends.torch.optim import lr_at

        cfg, ps = self.cfg.algo, self.ps
        if cfg.calculate_per_token_loss:
            normalizer = float(sum(sum(train_data["loss_masks"][i]) for i in plan.global_indices))
        else:
            normalizer = float(len(plan.global_indices))
        # megatron's schedule divides each micro-batch loss by their count and DDP averages over DP;
        # our losses are already normalised by the global batch, so undo both.
        scale = len(mbs) * ps.get_data_parallel_world_size()
        sums: dict[str, float] = {}
        entropy_grad = cfg.entropy_coef != 0

        def loss_fn(batch: PackedBatch, lp: torch.Tensor, ent: torch.Tensor | None):
            if ent is not None and not entropy_grad:
                ent = ent.detach()
            loss, metrics = _policy_loss(lp, None if self.is_sft else ent, batch, cfg, normalizer)
            for key, value in {"loss": loss, **metrics}.items():
                combine_metric(sums, key, float(value.detach() if isinstance(value, torch.Tensor) else value))
            return loss * scale, {}

        self.model.train()
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        self._run(self.model, mbs, forward_only=False, with_entropy=not self.is_sft, loss_fn=loss_fn)
        lr = lr_at(self.num_steps, self.cfg.optimizer)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        ok, grad_norm, _ = self.optimizer.step()
        grad_norm = float(grad_norm) if grad_norm is not None else 0.0
        skipped = 0.0
        if ok and math.isfinite(grad_norm):
            self.num_steps += 1
        else:
            skipped = 1.0
        out = {f"train/{k}": v for k, v in self._reduce_metrics(sums).items()}
        out.update({"train/grad_norm": grad_norm, "train/lr": lr, "train/skipped_step": skipped})
        return out

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
        values = torch.tensor([local.get(k, 0.0) for k in keys], dtype=torch.float64)
        out = {}
        if ps.is_pipeline_last_stage() and ps.get_data_parallel_world_size() > 1:
            group = ps.get_data_parallel_group()
            for op, pick in ((dist.ReduceOp.SUM, lambda k: not k.endswith(("_max", "_min"))),
                             (dist.ReduceOp.MAX, lambda k: k.endswith("_max")), (dist.ReduceOp.MIN, lambda k: k.endswith("_min"))):
                idx = [i for i, k in enumerate(keys) if pick(k)]
                if idx:
                    part = values[idx].clone()
                    dist.all_reduce(part, op=op, group=group)
                    values[idx] = part
        if ps.get_pipeline_model_parallel_world_size() > 1:
            group = ps.get_pipeline_model_parallel_group()
            dist.broadcast(values, src=dist.get_global_rank(group, ps.get_pipeline_model_parallel_world_size() - 1), group=group)
        out.update(zip(keys, values.tolist()))
        return out

    # ----------------------------------------------------------------------------------------------
    def offload(self) -> None:
        """Weights, gradients and optimizer state to host memory (nothing to do on CPU)."""
        if self.device == "cpu":
            return
        self.optimizer.offload_to_cpu()
        self.model.offload_grad_buffers()
        torch.cuda.empty_cache()

    def onload(self) -> None:
        if self.device == "cpu":
            return
        self.model.restore_grad_buffers()
        self.optimizer.restore_from_cpu()

    # ----------------------------------------------------------------------------------------------
    def save_checkpoint(self, directory: str) -> None:
        from miles.backends.megatron.checkpoint import save

        save(self, Path(directory))

    def load_checkpoint(self, directory: str) -> None:
        from miles.backends.megatron.checkpoint import load

        load(self, Path(directory))

    # ----------------------------------------------------------------------------------------------
    def iter_hf_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Collective: (HF name, full tensor) for every weight, in the rule tables' order."""
        from miles.ckpt.convert.mapping import megatron_to_hf, rules_for

        rules = {r.megatron: r for r in rules_for(self.shape)}
        for name, full in mm.iter_full_megatron_tensors(self.model, self.shape):
            yield from zip(rules[name].hf, megatron_to_hf(rules[name], full, self.shape))

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
            nbytes = sum(math.prod(shapes[n]) * 4 for n in r.hf)
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
                    bucket.extend(zip(rule.hf, megatron_to_hf(rule, full.clone(), self.shape)))
            yield bucket

    def weights_checksum(self) -> str:
        from miles.utils.weights import weights_checksum

        digest = weights_checksum(self.iter_hf_weights())
        obj = [digest]
        dist.broadcast_object_list(obj, src=0)
        return obj[0]
