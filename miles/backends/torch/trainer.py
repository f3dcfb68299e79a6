"""`TorchBackend`: the torch implementation of `TrainerBackend` (a HF causal LM, AdamW, DDP or FSDP2 over gloo/NCCL).

What one `train_step(train_data, rollout_id=...)` does, in upstream miles' order:

1. cut the rollout into `--num-steps-per-rollout` optimizer steps of `--global-batch-size` samples;
   this data-parallel rank takes its slice of each step, in micro-batches of `--micro-batch-size`
   samples (`batching.plan_steps`), each packed once into a `PackedBatch` (`packing.pack_samples`);
2. old log-probs: a no-grad forward of the actor before any update (or the rollout engine's log-probs
   with `--use-rollout-logprobs`; with one optimizer step per rollout, the detached log-probs of the
   training forward itself, which are the same numbers); reference log-probs from the frozen
   reference model when a KL term is on (`--use-kl-loss` or `--kl-coef`). All log-probs are of
   `logits / --rollout-temperature`, as the rollout engine scores them;
3. advantages and returns of all this rank's samples in one vectorised call
   (`miles.algo.advantages`); `--normalize-advantages` whitens with statistics summed over the
   whole data-parallel group, so DP=N whitens exactly like DP=1;
4. per step: forward, loss (`miles.algo.losses` on packed tokens), backward per micro-batch; the loss
   of each micro-batch is divided by the whole global batch's sample count (or trained-token count
   with `--calculate-per-token-loss`), so the accumulated gradient is the gradient of the global
   batch's mean loss however the batch is cut. With DP the model runs under torch's
   `DistributedDataParallel`, whose gradient all-reduce (a sum, by a comm hook, since the loss is
   already normalised by the global batch) overlaps the last micro-batch's backward. With
   `--train-backend fsdp` the model is sharded by FSDP2 instead (miles/backends/torch/fsdp.py) and
   gradients are reduce-scattered, also as a sum, after every micro-batch. Then clip, AdamW step,
   LR schedule.

The caller (`miles.ray.train_group.TrainWorker`) initialises `torch.distributed` (one process per
rank) and passes the same full `train_data` to every rank; each rank trains on its own shard.
Checkpoints are per rank (`save_checkpoint`/`load_checkpoint`, torch.distributed.checkpoint).

Use (in-process or inside a Ray actor):

    trainer = TorchBackend(cfg, rank=0, world_size=1, device="cpu")   # cfg: a resolved EngineConfig
    metrics = trainer.train_step(train_data, rollout_id=0)
    for bucket in trainer.iter_weight_buckets(cfg.rollout.update_weight_buffer_size): ...
"""

from __future__ import annotations

import contextlib
import math
import time
from typing import TYPE_CHECKING, Any, Callable, Iterator, Literal

import torch
import torch.distributed as dist

from miles.backends.base import PackedBatch, TrainerBackend
from miles.backends.loss import combine_metric, packed_loss
from miles.backends.packing import pack_samples
from miles.backends.torch.batching import StepPlan, plan_steps
from miles.backends.torch.fsdp import full_tensor
from miles.backends.torch.forward import ResponseLogits, response_log_probs
from miles.backends.torch.optim import LRSchedule, build_optimizer
from miles.backends.torch.rng import seed_everything

if TYPE_CHECKING:
    from miles.config.engine import EngineConfig

TrainData = dict[str, Any]


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
        if keys:
            packed = torch.tensor([local[k] for k in keys], dtype=torch.float64)
            dist.all_reduce(packed, op=op)
            out.update(zip(keys, packed.tolist()))
    return out


def _sum_gradients_hook(process_group, bucket):
    """DDP comm hook: sum (not average) gradients over ranks; the loss is already divided by the
    global batch, so the sum is the global batch's gradient, exactly as one process would get it."""
    fut = dist.all_reduce(bucket.buffer(), group=process_group, async_op=True).get_future()
    return fut.then(lambda f: f.value()[0])


def _sum_in_place(t: torch.Tensor) -> torch.Tensor:
    dist.all_reduce(t)
    return t


class TorchBackend(TrainerBackend):
    """The torch training backend. See the module docstring for the step it runs."""

    def __init__(self, cfg: "EngineConfig", *, rank: int = 0, world_size: int = 1, device: str = "cpu"):
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
        self.micro_batch_size = cfg.train.micro_batch_size
        self.temperature = cfg.rollout.rollout_temperature
        self.device = device
        self.rank, self.world_size = rank, world_size
        self.is_weight_source = rank == 0

        seed_everything(cfg.optimizer.seed, deterministic=cfg.train.deterministic_mode)
        self.fsdp = cfg.train.train_backend == "fsdp"
        """FSDP2 (`--train-backend fsdp`): parameters, gradients and AdamW state sharded over the
        ranks (miles/backends/torch/fsdp.py); otherwise every rank holds everything (DDP)."""
        if self.fsdp:
            from miles.backends.torch.fsdp import ensure_process_group

            ensure_process_group(device)
        self.model = _load_causal_lm(cfg.rollout.hf_checkpoint, device)
        self.model.train()
        self.net = ResponseLogits(self.model)
        self.train_net: torch.nn.Module = self.net
        if self.fsdp:
            from miles.backends.torch.fsdp import shard_response_logits

            shard_response_logits(self.net, device)  # in place: self.net is the FSDP root
        elif world_size > 1:
            # broadcast_buffers=False: the only buffers are rotary tables, identical on every rank.
            self.train_net = torch.nn.parallel.DistributedDataParallel(self.net, broadcast_buffers=False)
            self.train_net.register_comm_hook(None, _sum_gradients_hook)
        self.reuse_on_policy_log_probs = True
        """With one optimizer step per rollout, take the old log-probs from the training forward
        (identical numbers, one forward fewer). False forces the separate no-grad forward."""
        self.ref_model: torch.nn.Module | None = None
        self.ref_net: ResponseLogits | None = None
        if self.uses_reference:
            self.ref_model = _load_causal_lm(cfg.ckpt.ref_load or cfg.rollout.hf_checkpoint, device)
            self.ref_model.eval().requires_grad_(False)
            self.ref_net = ResponseLogits(self.ref_model)
            if self.fsdp:
                from miles.backends.torch.fsdp import shard_response_logits

                shard_response_logits(self.ref_net, device)
        self.optimizer = build_optimizer(self.model, cfg.optimizer)
        self.scheduler = LRSchedule(self.optimizer, cfg.optimizer)
        # Resolved once here so a bad --custom-loss-function-path fails at start-up, not mid-step.
        self.loss_fn: Callable[..., tuple[torch.Tensor, dict[str, Any]]] = get_loss_function(cfg.algo)

    # ----------------------------------------------------------------------------------------------
    @property
    def uses_reference(self) -> bool:
        """A frozen reference model is loaded when a KL term needs its log-probs."""
        return self.algo_cfg.use_kl_loss or self.algo_cfg.kl_coef != 0

    @property
    def is_sft(self) -> bool:
        return self.algo_cfg.loss_type == "sft_loss"

    # ----------------------------------------------------------------------------------------------
    def compute_log_probs(
        self, batch: PackedBatch, *, model: Literal["actor", "ref"] = "actor", with_entropy: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Per-response-token log-probs [R] (and entropy [R]) of the batch, no grad, at the rollout
        temperature. The batch runs as one forward: pack micro-batch-sized batches for big rollouts."""
        net = self.net if model == "actor" else self.ref_net
        if net is None:
            raise RuntimeError("no reference model is loaded: it is loaded only when --use-kl-loss or --kl-coef is set")
        with torch.no_grad():
            lp, ent = response_log_probs(net, batch, temperature=self.temperature, with_entropy=with_entropy)
        return lp.detach(), None if ent is None else ent.detach()

    # ----------------------------------------------------------------------------------------------
    def train_step(self, train_data: TrainData, *, rollout_id: int) -> dict[str, float]:
        """Train on one rollout (see the module docstring); returns `train/*` and `perf/*` metrics.

        `train_data` is the whole rollout (every DP rank gets the same dict): `tokens`,
        `response_lengths`, `rewards` (already normalised per sample), `loss_masks`, and optionally
        `rollout_log_probs`. Metrics are means over the optimizer steps of this rollout, except
        `train/lr` (the lr of the last step). `rollout_id` only labels errors and logs.
        """
        t0 = time.perf_counter()
        d = self.cfg.data
        n = len(train_data["tokens"])
        plans = plan_steps(
            n,
            global_batch_size=d.global_batch_size,
            num_steps=d.num_steps_per_rollout or 1,
            micro_batch_size=self.micro_batch_size,
            dp_rank=self.rank,
            dp_world_size=self.world_size,
        )
        local = [i for p in plans for i in p.local_indices]
        batches = {tuple(mb): pack_samples(train_data, mb, self.device) for p in plans for mb in p.micro_batches}
        if not self.is_sft:
            # No whole-groups requirement: group statistics were taken over whole groups on the rollout
            # side and every estimator here works per sample, so a rank may hold part of a group.
            self._prepare_policy_inputs(train_data, plans, local, batches)

        step_metrics = [self._optimizer_step(train_data, plan, batches) for plan in plans]
        metrics: dict[str, float] = {}
        for key in step_metrics[0]:
            values = [m[key] for m in step_metrics]
            if key == "train/lr":
                metrics[key] = values[-1]
            elif key.endswith("_max"):
                metrics[key] = max(values)
            elif key.endswith("_min"):
                metrics[key] = min(values)
            else:
                metrics[key] = sum(values) / len(values)
        elapsed = time.perf_counter() - t0
        local_tokens = sum(len(train_data["tokens"][i]) for i in local)
        metrics["perf/train_step_time"] = elapsed
        metrics["perf/train_tokens_per_s"] = local_tokens * self.world_size / elapsed if elapsed > 0 else 0.0
        return metrics

    def _prepare_policy_inputs(
        self, train_data: TrainData, plans: list[StepPlan], local: list[int], batches: dict[tuple, PackedBatch]
    ) -> None:
        """Fill old/ref log-probs, advantages and returns of every micro-batch of this rank."""
        from miles.algo.advantages import compute_advantages_and_returns
        from miles.algo.segments import Segments

        ordered = [batches[tuple(mb)] for p in plans for mb in p.micro_batches]  # in `local` order
        if self.algo_cfg.use_rollout_logprobs:
            if any(b.rollout_log_probs is None for b in ordered):
                raise ValueError("--use-rollout-logprobs is set but the train data has no rollout_log_probs")
            for b in ordered:
                b.old_log_probs = b.rollout_log_probs
        elif len(plans) == 1 and self.algo_cfg.kl_coef == 0 and self.reuse_on_policy_log_probs:
            # One optimizer step per rollout: the weights do not change before the training forward,
            # which runs the same micro-batches, so its detached log-probs ARE the old log-probs (bit
            # for bit); skip a whole forward pass. kl_coef needs them earlier, for the advantages.
            pass
        else:
            for b in ordered:
                b.old_log_probs = self.compute_log_probs(b)[0]
        if self.ref_net is not None:
            for b in ordered:
                b.ref_log_probs = self.compute_log_probs(b, model="ref")[0]

        cat = lambda name: None if getattr(ordered[0], name) is None else torch.cat([getattr(b, name) for b in ordered])  # noqa: E731
        advantages, returns = compute_advantages_and_returns(
            self.algo_cfg,
            rewards=torch.tensor([float(train_data["rewards"][i]) for i in local], dtype=torch.float32, device=self.device),
            loss_mask=torch.cat([b.loss_mask for b in ordered]),
            segments=Segments.from_lengths(torch.cat([b.response_lengths for b in ordered])),
            n_samples_per_prompt=self.cfg.data.n_samples_per_prompt,
            log_probs=cat("old_log_probs"),
            ref_log_probs=cat("ref_log_probs"),
            all_reduce=_sum_in_place if self.world_size > 1 else None,
        )
        sizes = [b.loss_mask.numel() for b in ordered]
        for b, a, r in zip(ordered, advantages.split(sizes), returns.split(sizes)):
            b.advantages, b.returns = a, r

    def _optimizer_step(self, train_data: TrainData, plan: StepPlan, batches: dict[tuple, PackedBatch]) -> dict[str, float]:
        from miles.algo.segments import Segments

        cfg = self.algo_cfg
        if cfg.calculate_per_token_loss:
            normalizer = float(sum(sum(train_data["loss_masks"][i]) for i in plan.global_indices))
        else:
            normalizer = float(len(plan.global_indices))
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        sums: dict[str, float] = {}
        last = len(plan.micro_batches) - 1
        for k, mb in enumerate(plan.micro_batches):
            batch = batches[tuple(mb)]
            # DDP: gradients of all but the last micro-batch stay local; it all-reduces on the last
            # backward. FSDP reduce-scatters every micro-batch, so no rank ever holds a full gradient.
            ddp = self.world_size > 1 and not self.fsdp
            sync = self.train_net.no_sync() if ddp and k < last else contextlib.nullcontext()
            with sync:
                log_probs, entropy = response_log_probs(
                    self.train_net,
                    batch,
                    temperature=self.temperature,
                    with_entropy=not self.is_sft,
                    entropy_grad=cfg.entropy_coef != 0,
                )
                loss, metrics = packed_loss(cfg, log_probs, None if self.is_sft else entropy, batch, normalizer)
                loss.backward()
            metrics = {"loss": loss, **metrics}
            for key, value in metrics.items():
                combine_metric(sums, key, float(value.detach() if isinstance(value, torch.Tensor) else value))

        if self.world_size > 1:
            sums = _all_reduce_metrics(sums)

        params = [p for p in self.model.parameters() if p.requires_grad]
        max_norm = self.optimizer_cfg.clip_grad if self.optimizer_cfg.clip_grad > 0 else math.inf
        # Under FSDP the gradients are shards (DTensors); clip_grad_norm_ reduces their norms over the
        # ranks, so this is the global norm on every rank, as one process would compute it.
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm))
        lr = self.scheduler.current_lr()
        skipped = 0.0
        if math.isfinite(grad_norm):
            self.scheduler.apply()
            self.optimizer.step()
            self.scheduler.advance()
        else:
            # A NaN/inf gradient would poison every weight and both Adam moments; drop this step.
            self.optimizer.zero_grad(set_to_none=True)
            skipped = 1.0
        out = {f"train/{k}": v for k, v in sums.items()}
        out.update({"train/grad_norm": grad_norm, "train/lr": lr, "train/skipped_step": skipped})
        return out

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
        for net in (self.net, self.ref_net):
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

        checkpoint.save(directory, model=self.model, optimizer=self.optimizer, scheduler=self.scheduler, rank=self.rank)

    def load_checkpoint(self, directory: str) -> None:
        from miles.backends.torch import checkpoint

        checkpoint.load(directory, model=self.model, optimizer=self.optimizer, scheduler=self.scheduler, rank=self.rank)

    # ----------------------------------------------------------------------------------------------
    def named_weights_for_sync(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(Hugging Face name, full tensor) for every weight, each parameter once (a tied lm_head is
        skipped, as in HF's safetensors). Unsharded, the tensors are the live weights, detached: copy
        them before the next `train_step`. Under FSDP each is gathered when the iterator reaches it,
        a collective: every rank must iterate to the end."""
        seen: set[int] = set()
        # keep_vars: the Parameter objects themselves, so a tied weight is one object under two names
        # on every rank (a storage pointer would not do: an empty shard has none).
        for name, tensor in self.model.state_dict(keep_vars=True).items():
            if id(tensor) in seen:
                continue
            seen.add(id(tensor))
            yield name, full_tensor(tensor.detach())

    def iter_weight_buckets(self, bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """HF-named full weights in buckets of at most `bucket_bytes` (a bigger tensor travels alone).

        Every rank plans the same buckets (under FSDP gathering each tensor with the other ranks; under
        DDP every rank already holds it), and ranks other than the weight source yield them empty.
        """
        from miles.utils.weights import iter_weight_buckets

        for bucket in iter_weight_buckets(self.named_weights_for_sync(), bucket_bytes):
            yield bucket if self.is_weight_source else []

    def weights_checksum(self) -> str:
        from miles.utils.weights import weights_checksum

        return weights_checksum(self.named_weights_for_sync())
