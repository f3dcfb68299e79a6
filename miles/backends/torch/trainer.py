"""`TorchTrainer`: trains a Hugging Face causal LM with the policy (or SFT) loss of `miles.algo`.

What one `train_step(train_data, rollout_id=...)` does, in upstream miles' order:

1. cut the rollout into `num_steps_per_rollout` optimizer steps of `global_batch_size` samples; this
   data-parallel rank takes its slice of each step (`batching.plan_steps`);
2. old log-probs: a no-grad forward of the actor before any update (or the rollout engine's log-probs
   with `--use-rollout-logprobs`; with one optimizer step per rollout, the detached log-probs of the
   training forward itself, which are the same numbers); reference log-probs from the frozen reference model when a KL term
   is on (`--use-kl-loss` or `--kl-coef`);
3. advantages and returns from the rewards (`miles.algo.advantages`);
4. per step: micro-batches of `micro_batch_size` samples, forward, loss, backward (gradients
   accumulate); the loss of each micro-batch is divided by the whole global batch's sample count
   (or trained-token count with `--calculate-per-token-loss`), so the accumulated gradient is the
   gradient of the global batch's mean loss however the batch is cut; with DP the gradients are
   summed over ranks (gloo/NCCL all-reduce), which gives the same mean; then clip, AdamW step, LR
   schedule.

It is not a distributed launcher: for DP the caller initialises `torch.distributed` (one process per
rank) and passes the same full `train_data` to every rank; each rank trains on its own shard.

Use (in-process or inside a Ray actor):

    trainer = TorchTrainer(hf_dir, optimizer_cfg=cfg.optimizer, algo_cfg=cfg.algo, micro_batch_size=2,
                           deterministic=True, seed=cfg.optimizer.seed,
                           temperature=cfg.rollout.rollout_temperature)
    metrics = trainer.train_step(train_data, rollout_id=0, global_batch_size=8, num_steps_per_rollout=1)
    for name, tensor in trainer.named_weights_for_sync(): ...   # HF names, for the rollout engine
"""

from __future__ import annotations

import math
import time
from typing import Any, Callable, Iterator, Literal, Sequence

import torch
import torch.distributed as dist

from miles.backends.torch.batching import StepPlan, plan_steps
from miles.backends.torch.forward import response_log_probs
from miles.backends.torch.optim import LRSchedule, build_optimizer
from miles.backends.torch.rng import get_rng_state, seed_everything, set_rng_state
from miles.config.algo import AlgoConfig
from miles.config.optimizer import OptimizerConfig

STATE_FORMAT = "miles.torch_trainer.v1"

TrainData = dict[str, Any]


def _load_causal_lm(hf_dir: str, device: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    # fp32 weights: the trainer's master copy; eager attention gives the same numbers on every
    # platform (sdpa may pick a different kernel per device).
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager")
    return model.to(device)


def _combine(acc: dict[str, float], key: str, value: float) -> None:
    """Fold one micro-batch's metric into the step's: `*_max`/`*_min` by max/min, the rest by sum
    (the losses normalise by the whole step, so the sum over micro-batches is the step's mean)."""
    if key not in acc:
        acc[key] = value
    elif key.endswith("_max"):
        acc[key] = max(acc[key], value)
    elif key.endswith("_min"):
        acc[key] = min(acc[key], value)
    else:
        acc[key] += value


def _all_reduce_metrics(local: dict[str, float]) -> dict[str, float]:
    """Combine metrics over DP ranks like `_combine` does over micro-batches (same keys on every rank)."""
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


class TorchTrainer:
    """The torch training backend. See the module docstring for the step it runs."""

    def __init__(
        self,
        hf_dir: str,
        *,
        optimizer_cfg: OptimizerConfig,
        algo_cfg: AlgoConfig,
        micro_batch_size: int,
        deterministic: bool,
        seed: int,
        device: str = "cpu",
        dp_rank: int = 0,
        dp_world_size: int = 1,
        ref_hf_dir: str | None = None,
        temperature: float = 1.0,
    ):
        from miles.algo.entropy import entropy_from_logits
        from miles.algo.losses import get_loss_function

        if dp_world_size > 1:
            if not (dist.is_available() and dist.is_initialized()):
                raise RuntimeError(
                    f"dp_world_size={dp_world_size} needs torch.distributed initialised by the caller "
                    "(one process per rank) before the trainer is built"
                )
            if dist.get_world_size() != dp_world_size or dist.get_rank() != dp_rank:
                raise RuntimeError(
                    f"trainer given dp_rank={dp_rank}/dp_world_size={dp_world_size} but the process group is "
                    f"rank {dist.get_rank()} of {dist.get_world_size()}"
                )
        self.optimizer_cfg = optimizer_cfg
        self.algo_cfg = algo_cfg
        self.micro_batch_size = micro_batch_size
        self.deterministic = deterministic
        self.device = device
        self.dp_rank = dp_rank
        self.dp_world_size = dp_world_size
        self.temperature = temperature
        """The rollout temperature: every forward (old, ref, training) scores softmax(logits / T), the
        distribution the engine sampled from (forward.scale_logits_by_temperature)."""

        seed_everything(seed, deterministic=deterministic)
        self.model = _load_causal_lm(hf_dir, device)
        self.model.train()
        self.reuse_on_policy_log_probs = True
        """With one optimizer step per rollout, take the old log-probs from the training forward
        (identical numbers, one forward fewer). False forces the separate no-grad forward."""
        self.ref_model: torch.nn.Module | None = None
        if self.uses_reference:
            self.ref_model = _load_causal_lm(ref_hf_dir or hf_dir, device)
            self.ref_model.eval().requires_grad_(False)
        self.optimizer = build_optimizer(self.model, optimizer_cfg)
        self.scheduler = LRSchedule(self.optimizer, optimizer_cfg)
        self.loss_fn: Callable[..., tuple[torch.Tensor, dict[str, Any]]] = get_loss_function(algo_cfg)
        # Entropy is always reported (train/entropy_loss); it carries gradient only when it is in the loss.
        self._entropy_fn: Callable[[torch.Tensor], torch.Tensor] = (
            entropy_from_logits if algo_cfg.entropy_coef != 0 else (lambda logits: entropy_from_logits(logits.detach()))
        )

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
        self,
        train_data: TrainData,
        *,
        model: Literal["actor", "ref"] = "actor",
        indices: Sequence[int] | None = None,
    ) -> list[torch.Tensor]:
        """Per-sample response-token log-probs (no gradient), micro-batched by `micro_batch_size`.

        `indices` picks samples (default: all, in order); the result follows that order.
        """
        net = self.model if model == "actor" else self.ref_model
        if net is None:
            raise RuntimeError("no reference model is loaded: it is loaded only when --use-kl-loss or --kl-coef is set")
        if indices is None:
            indices = range(len(train_data["tokens"]))
        indices = list(indices)
        batches = [indices[i : i + self.micro_batch_size] for i in range(0, len(indices), self.micro_batch_size)]
        return self._forward_no_grad(net, train_data, batches)

    def _forward_no_grad(
        self, net: torch.nn.Module, train_data: TrainData, micro_batches: Sequence[Sequence[int]]
    ) -> list[torch.Tensor]:
        out: list[torch.Tensor] = []
        with torch.no_grad():
            for mb in micro_batches:
                lps, _ = response_log_probs(
                    net,
                    [train_data["tokens"][i] for i in mb],
                    [train_data["response_lengths"][i] for i in mb],
                    device=self.device,
                    temperature=self.temperature,
                )
                out.extend(lp.detach() for lp in lps)
        return out

    # ----------------------------------------------------------------------------------------------
    def train_step(
        self,
        train_data: TrainData,
        *,
        rollout_id: int,
        global_batch_size: int | None = None,
        num_steps_per_rollout: int = 1,
        n_samples_per_prompt: int = 1,
    ) -> dict[str, float]:
        """Train on one rollout (see the module docstring); returns `train/*` and `perf/*` metrics.

        `train_data` is the whole rollout (every DP rank gets the same dict): `tokens`,
        `response_lengths`, `rewards` (already normalised per sample), `loss_masks`, and optionally
        `rollout_log_probs`. Metrics are means over the optimizer steps of this rollout, except
        `train/lr` (the lr of the last step). `rollout_id` only labels errors and logs.
        """
        t0 = time.perf_counter()
        n = len(train_data["tokens"])
        plans = plan_steps(
            n,
            global_batch_size=global_batch_size,
            num_steps=num_steps_per_rollout,
            micro_batch_size=self.micro_batch_size,
            dp_rank=self.dp_rank,
            dp_world_size=self.dp_world_size,
        )
        local = [i for p in plans for i in p.local_indices]
        masks = {
            i: torch.as_tensor(train_data["loss_masks"][i], dtype=torch.float32, device=self.device) for i in local
        }
        per_sample: dict[str, dict[int, torch.Tensor]] = {}
        if not self.is_sft:
            # A rank may hold part of a prompt group (e.g. 8 samples per prompt, 4 per rank): the group
            # statistics were taken over whole groups on the rollout side, and every estimator here
            # works per sample (whitening is reduced over the DP group).
            per_sample = self._prepare_policy_inputs(train_data, plans, local, masks, n_samples_per_prompt)

        step_metrics: list[dict[str, float]] = []
        for plan in plans:
            step_metrics.append(self._optimizer_step(train_data, plan, masks, per_sample, rollout_id))

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
        metrics["perf/train_tokens_per_s"] = local_tokens * self.dp_world_size / elapsed if elapsed > 0 else 0.0
        return metrics

    def _prepare_policy_inputs(
        self,
        train_data: TrainData,
        plans: list[StepPlan],
        local: list[int],
        masks: dict[int, torch.Tensor],
        n_samples_per_prompt: int,
    ) -> dict[str, dict[int, torch.Tensor]]:
        """Old log-probs, ref log-probs, rollout log-probs and advantages of this rank's samples."""
        from miles.algo.advantages import compute_advantages_and_returns

        # The same micro-batches as training, so with one step per rollout the first step's ratio is
        # exactly 1 (identical padding, identical arithmetic).
        micro_batches = [mb for p in plans for mb in p.micro_batches]
        out: dict[str, dict[int, torch.Tensor]] = {}
        rollout_lp = train_data.get("rollout_log_probs")
        if rollout_lp is not None:
            out["rollout_log_probs"] = {
                i: torch.as_tensor(rollout_lp[i], dtype=torch.float32, device=self.device) for i in local
            }
        old: list[torch.Tensor] | None
        if self.algo_cfg.use_rollout_logprobs:
            if rollout_lp is None:
                raise ValueError("--use-rollout-logprobs is set but the train data has no rollout_log_probs")
            old = [out["rollout_log_probs"][i] for i in local]
        elif len(plans) == 1 and self.algo_cfg.kl_coef == 0 and self.reuse_on_policy_log_probs:
            # One optimizer step per rollout: the weights do not change before the training forward,
            # which runs the same micro-batches, so its detached log-probs ARE the old log-probs (bit
            # for bit); skip a whole forward pass. kl_coef needs them earlier, for the advantages.
            old = None
        else:
            old = self._forward_no_grad(self.model, train_data, micro_batches)
        if old is not None:
            out["old_log_probs"] = dict(zip(local, old))
        ref = None
        if self.ref_model is not None:
            ref = self._forward_no_grad(self.ref_model, train_data, micro_batches)
            out["ref_log_probs"] = dict(zip(local, ref))
        rewards = torch.as_tensor([float(train_data["rewards"][i]) for i in local], dtype=torch.float32)
        advantages, returns = compute_advantages_and_returns(
            self.algo_cfg,
            rewards=rewards,
            loss_masks=[masks[i] for i in local],
            n_samples_per_prompt=n_samples_per_prompt,
            log_probs=old,
            ref_log_probs=ref,
            all_reduce=dist.all_reduce if self.dp_world_size > 1 else None,
        )
        out["advantages"] = dict(zip(local, advantages))
        out["returns"] = dict(zip(local, returns))
        return out

    def _optimizer_step(
        self,
        train_data: TrainData,
        plan: StepPlan,
        masks: dict[int, torch.Tensor],
        per_sample: dict[str, dict[int, torch.Tensor]],
        rollout_id: int,
    ) -> dict[str, float]:
        cfg = self.algo_cfg
        if cfg.calculate_per_token_loss:
            normalizer = float(sum(sum(train_data["loss_masks"][i]) for i in plan.global_indices))
        else:
            normalizer = float(len(plan.global_indices))
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        sums: dict[str, float] = {}
        for mb in plan.micro_batches:
            log_probs, entropy = response_log_probs(
                self.model,
                [train_data["tokens"][i] for i in mb],
                [train_data["response_lengths"][i] for i in mb],
                entropy_fn=None if self.is_sft else self._entropy_fn,
                device=self.device,
                temperature=self.temperature,
            )
            mb_masks = [masks[i] for i in mb]
            if self.is_sft:
                loss, metrics = self.loss_fn(cfg, log_probs=log_probs, loss_masks=mb_masks, normalizer=normalizer)
            else:
                pick = lambda key: [per_sample[key][i] for i in mb] if key in per_sample else None  # noqa: E731
                old = pick("old_log_probs")
                loss, metrics = self.loss_fn(
                    cfg,
                    log_probs=log_probs,
                    old_log_probs=old if old is not None else [lp.detach() for lp in log_probs],
                    advantages=pick("advantages"),
                    loss_masks=mb_masks,
                    ref_log_probs=pick("ref_log_probs"),
                    rollout_log_probs=pick("rollout_log_probs"),
                    entropy=entropy,
                    normalizer=normalizer,
                )
            loss.backward()
            metrics = {"loss": loss, **metrics}
            for key, value in metrics.items():
                _combine(sums, key, float(value.detach() if isinstance(value, torch.Tensor) else value))

        if self.dp_world_size > 1:
            self._all_reduce_grads()
            sums = _all_reduce_metrics(sums)

        params = [p for p in self.model.parameters() if p.requires_grad]
        max_norm = self.optimizer_cfg.clip_grad if self.optimizer_cfg.clip_grad > 0 else math.inf
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

    def _all_reduce_grads(self) -> None:
        """Sum gradients over DP ranks in one flat buffer (one collective instead of one per tensor)."""
        params = [p for p in self.model.parameters() if p.requires_grad]
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        dist.all_reduce(flat)
        offset = 0
        for p in params:
            numel = p.grad.numel()
            p.grad.copy_(flat[offset : offset + numel].view_as(p.grad))
            offset += numel

    # ----------------------------------------------------------------------------------------------
    def named_weights_for_sync(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(Hugging Face name, tensor) for every weight, each storage once (a tied lm_head is skipped,
        as in HF's safetensors). The tensors are the live weights, detached: copy them before the
        next `train_step`."""
        seen: set[int] = set()
        for name, tensor in self.model.state_dict().items():
            ptr = tensor.untyped_storage().data_ptr()
            if ptr in seen:
                continue
            seen.add(ptr)
            yield name, tensor.detach()

    # ----------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Model, optimizer, LR schedule and this process's RNG states (tensors and plain data only,
        loadable with `torch.load(weights_only=True)`). The tensors are live references: save or copy
        them before the next `train_step`."""
        return {
            "format": STATE_FORMAT,
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "rng": get_rng_state(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` returned, RNG states included."""
        if state.get("format") != STATE_FORMAT:
            raise ValueError(f"not a torch trainer state (format {state.get('format')!r}, expected {STATE_FORMAT!r})")
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        set_rng_state(state["rng"])
