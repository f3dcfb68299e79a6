"""The rollout manager: prompts → engines → rewards → train data, and eval, behind one object.

It owns the rollout engine (made by `miles.ray.engine_factory.make_engine` from --rollout-backend:
the built-in engine in-process, or a fleet of engine servers behind sglang-router with
--rollout-num-gpus), the prompt data source, the eval datasets and the reward settings. The driver
runs it as one Ray actor and talks to it only through the methods below; it can also be used
in-process (tests).

Generation is per sample and asynchronous: each sample is made by the generate function
(`miles.rollout.generate_hub`: single-turn, or --custom-generate-function-path) in its own task, and
reaches the engines through one `EngineClient` that sends a draw's requests together. A training
rollout draws whole prompt groups, scores each group as soon as its last sample is back and applies
the dynamic-sampling filter to it; while
fewer groups are in flight than are still missing it draws --over-sampling-batch-size more (upstream's
group-level rule). Once --rollout-batch-size groups are kept, the groups still in flight are aborted
and go back to the data source, first in line for the next step. Kept groups are put in the order
they were drawn, so a run without over-sampling is reproducible whatever order requests finish in.
--rollout-function-path replaces all of that with a function of the user's (see `generate_hub`).

Sampling is reproducible without saving engine RNG state: every request carries its own seed derived
from (--rollout-seed, rollout id, sample index), so a resumed run regenerates exactly what an
uninterrupted run would have.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from pathlib import Path
from typing import Any

import torch

from miles.config.engine import EngineConfig
from miles.config.reward import split_rm_type
from miles.errors import UserError
from miles.ray.device import pick_device
from miles.ray.engine_factory import make_engine
from miles.ray.weight_sync import BucketChannel, InProcessTargets, current_node_id
from miles.rollout.data_source import PromptDataset, RolloutDataSource
from miles.rollout.engine.base import SamplingParams
from miles.rollout.engine.tensor_ipc import SharedBucket, SharedBucketReader
from miles.rollout.engine.weight_transport import EngineTarget, WeightTargets, transport_targets
from miles.rollout.filters import apply_group_filter, load_group_filter
from miles.rollout.generate_hub import (
    EngineClient,
    GenerateInput,
    RolloutFnInput,
    load_generate_function,
    load_rollout_function,
    request_seed,
)
from miles.rollout.generate_hub.loading import GENERATE_FLAG, ROLLOUT_FLAG
from miles.rollout.generate_hub.turn_metrics import turn_metrics
from miles.rollout.generate_hub.types import as_groups, as_samples
from miles.rollout.rm_hub import compute_group_rewards, compute_reward, effective_rm_type
from miles.rollout.sft_rollout import rollout_function_path
from miles.rollout.tools.execution import load_tool_specs
from miles.rollout.train_data import samples_to_train_data
from miles.sample import Sample, SampleStatus
from miles.utils.load_function import load_function


def _as_fresh(s: Sample) -> Sample:
    """A sample given back to the data source: its prompt (and prompt token ids) and numbering, no response."""
    return dataclasses.replace(
        s, tokens=s.tokens[: len(s.tokens) - s.response_length], response="", response_length=0, reward=None, rollout_log_probs=None, status=SampleStatus.PENDING, weight_version=None,
        weight_versions=None, loss_mask=None,
    )


def _as_partial(s: Sample) -> Sample:
    """--partial-rollout: a sample given back with what it generated so far (tokens, log-probs, their weight
    versions), to be continued in a later rollout; only the reward is dropped (it scored an unfinished response)."""
    return dataclasses.replace(s, reward=None)


_TO_GENERATE = (SampleStatus.PENDING, SampleStatus.ABORTED)
# Reward types scored with `compute_group_rewards`' task per sample: the remote RM waits on HTTP, and the
# random reward draws from `random` in the order its tasks run.
_SCORED_CONCURRENTLY = ("remote_rm", "random")


def _with_seed(params: SamplingParams, seed: int) -> SamplingParams:
    """`dataclasses.replace(params, seed=seed)` without running `__init__` and `__post_init__` again:
    `params` is checked already and the seed is not; once per sample, replace cost ~3 µs."""
    out = object.__new__(type(params))
    out.__dict__.update(params.__dict__)
    out.seed = seed
    return out


def staleness_metrics(samples: list[Sample], current_version: int) -> dict[str, float]:
    """rollout/weight_staleness_{mean,max}: per sample, the trainer's weight version when it trains the
    sample (rollout r trains on version r, the weights after r updates) minus the oldest version among its
    tokens: 0 in the synchronous loop, 1 with one-step overlap."""
    lags = [current_version - v for v in (s.oldest_weight_version() for s in samples) if v is not None]
    if not lags:
        return {}
    return {"rollout/weight_staleness_mean": sum(lags) / len(lags), "rollout/weight_staleness_max": float(max(lags))}


def engine_tp_size(cfg: EngineConfig) -> int:
    """Processes (TP ranks) per engine server: SGLang's --tp-size, 1 for the built-in engine server."""
    if cfg.rollout.rollout_backend != "sglang":
        return 1
    from miles.rollout.sglang.launch import engine_layout

    return engine_layout(cfg).gpus_per_engine


class RolloutManager:
    def __init__(
        self,
        cfg: EngineConfig,
        *,
        threads: int | None = None,
        train_data: bool = True,
        engine_actor_options: list[dict[str, Any]] | None = None,
        log_dir: str | None = None,
    ):
        # threads=None (a run's actor): the in-process engine shares the node's cores with whatever generates
        # at the same time (miles/ray/threads.py); `miles eval` passes its own count
        if threads is None:
            from miles.ray.threads import actor_threads

            actor_threads(cfg, "rollout")
        else:
            torch.set_num_threads(threads)
        self.cfg = cfg
        r, d = cfg.rollout, cfg.data
        self.log_dir = log_dir
        self.engine = make_engine(cfg, device=pick_device(cfg.cluster.device), actor_options=engine_actor_options, log_dir=log_dir)
        self.tokenizer = self.engine.tokenizer
        if self.tokenizer is None:  # engine servers: the manager still tokenizes prompts itself
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(r.hf_checkpoint, local_files_only=True)
        if train_data:  # `miles eval` needs only the eval datasets
            # --loss-type sft_loss trains on the rows' conversations (miles.rollout.sft_rollout)
            self.dataset = PromptDataset.from_config(d, r, self.tokenizer, conversations=cfg.algo.loss_type == "sft_loss")
            self.data_source = RolloutDataSource(self.dataset, shuffle=r.rollout_shuffle, seed=r.rollout_seed)
        self.eval_datasets: dict[str, PromptDataset] = {}
        pairs = cfg.eval.eval_prompt_data or []
        for name, path in zip(pairs[0::2], pairs[1::2]):
            self.eval_datasets[name] = PromptDataset(
                path,
                tokenizer=self.tokenizer,
                input_key=cfg.eval.eval_input_key,
                label_key=cfg.eval.eval_label_key,
                metadata_key=d.metadata_key,
                tool_key=d.tool_key,
                apply_chat_template=d.apply_chat_template,
                apply_chat_template_kwargs=d.apply_chat_template_kwargs,
                max_prompt_len=r.rollout_max_prompt_len,
                flag="--eval-prompt-data",
                default_tools=load_tool_specs(r.generate_tool_specs_path),
            )
        self.dynamic_filter = load_group_filter(r.dynamic_sampling_filter_path)
        rw = cfg.reward
        self.reward_post_process = load_function(rw.custom_reward_post_process_path, flag="--custom-reward-post-process-path")
        self.custom_convert = load_function(rw.custom_convert_samples_to_train_data_path, flag="--custom-convert-samples-to-train-data-path")
        self.client = EngineClient(self.engine)
        self.generate_fn = load_generate_function(r.custom_generate_function_path)
        self.rollout_fn = load_rollout_function(rollout_function_path(cfg)) if train_data else None
        self._state_before: dict[int, dict[str, Any]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None  # the rollouts' and evals' event loop (`_run`)
        self._async_worker = None  # --fully-async: miles.ray.fully_async.AsyncRolloutWorker
        self._shared_weights = None  # the in-process sync's SharedBucketReader (its segment stays mapped)
        self._bucket_channel = None  # its BucketChannel: trainer ranks on this node send buckets without Ray
        self.teacher = None  # --use-opd --opd-type sglang: the teacher engine scores every rollout's samples
        o = cfg.opd
        if train_data and o.use_opd and o.opd_type == "sglang":
            from miles.rollout.opd_teacher import TeacherScorer

            self.teacher = TeacherScorer(o.opd_teacher_urls[0], student_dir=r.hf_checkpoint, temperature=r.rollout_temperature)

    # ------------------------------------------------------------------ generation
    def _run(self, coro):
        """`asyncio.run(coro)` on one event loop kept for the manager's life. A fresh loop per rollout
        cost ~1-4 ms of a ~40 ms in-process rollout: the loop and its selector made and closed, and
        `asyncio.run`'s SIGINT handler installed and removed (in the main thread, which Ray's actor
        methods run on), where `signal.getsignal` formats the handler's repr, which holds the main
        task and every sample its coroutine refers to. As `asyncio.run` does, tasks the coroutine left
        (an error mid-rollout) are cancelled and awaited before returning, so none runs on into the
        next rollout."""
        if self._loop is None or self._loop.is_closed():
            self._loop = asyncio.new_event_loop()
        loop = self._loop
        try:
            return loop.run_until_complete(coro)
        finally:
            left = asyncio.all_tasks(loop)
            for task in left:
                task.cancel()
            if left:
                loop.run_until_complete(asyncio.gather(*left, return_exceptions=True))

    def num_prompts(self) -> int:
        return len(self.dataset)

    async def _generate_sample(
        self, s: Sample, *, rollout_id: int, purpose: str, params: SamplingParams, rid: str | None = None, evaluation: bool = False
    ) -> list[Sample]:
        """The samples the generate function (--custom-generate-function-path) makes of `s`. Each
        sample gets its own seed, from --rollout-seed, the rollout id and the sample index."""
        seed = request_seed(self.cfg.rollout.rollout_seed, rollout_id, s.index or 0, purpose=purpose)
        out = await self.generate_fn(
            GenerateInput(
                sample=s, sampling_params=_with_seed(params, seed), engine=self.client, cfg=self.cfg,
                tokenizer=self.tokenizer, rollout_id=rollout_id, evaluation=evaluation, rid=rid,
            )
        )
        return as_samples(out, s, flag=GENERATE_FLAG)

    async def _generate_group(self, group: list[Sample], *, rid: str | None = None, **kw: Any) -> list[Sample]:
        """Every sample of `group` at once (one task each); the samples made of them, in order. A partial
        rollout's finished samples (--partial-rollout) are kept as they are; its aborted ones continue."""

        async def finished(s: Sample) -> list[Sample]:
            return [s]

        outs = await asyncio.gather(
            *(
                self._generate_sample(s, rid=None if rid is None else f"{rid}{j:04d}", **kw) if s.status in _TO_GENERATE else finished(s)
                for j, s in enumerate(group)
            )
        )
        return [x for out in outs for x in out]

    async def _score_group(self, group: list[Sample]) -> None:
        """Rewards for the group's samples that have none (a generate function may set its own).
        Rewards computed in this process (no custom function, no remote RM) and drawing no random
        numbers are awaited one after the other in this task: a task per sample was half of a rollout's
        asyncio tasks for functions that never wait. The others keep `compute_group_rewards`' concurrency
        (and the random reward its order of draws)."""
        todo = group if all(s.reward is None for s in group) else [s for s in group if s.reward is None]
        if not todo:
            return
        r = self.cfg.reward
        if r.custom_rm_path or any(split_rm_type(effective_rm_type(r, s))[1] in _SCORED_CONCURRENTLY for s in todo):
            rewards = await compute_group_rewards(r, todo)
        else:
            rewards = [await compute_reward(r, s) for s in todo]
        for s, reward in zip(todo, rewards):
            s.reward = reward

    async def _group(self, group: list[Sample], **kw: Any) -> tuple[list[Sample], int]:
        """Generate one prompt group and score it: its samples and their generated tokens."""
        samples = await self._generate_group(group, **kw)
        await self._score_group(samples)
        return samples, sum(s.response_length for s in samples)

    async def _collect(self, rollout_id: int) -> tuple[list[list[Sample]], dict[str, float], int]:
        """Kept groups (in draw order), counts of dropped/aborted groups, generated tokens."""
        d, r = self.cfg.data, self.cfg.rollout
        target = d.rollout_batch_size
        prefix = f"train-{rollout_id:06d}-"  # fixed width: SGLang aborts by rid prefix
        kept: list[tuple[int, list[Sample]]] = []
        spare: list[tuple[int, list[Sample]]] = []
        counts: dict[str, float] = {}
        pending: dict[asyncio.Future, tuple[int, list[Sample]]] = {}
        tokens = pulls = drawn = 0
        params = SamplingParams.from_rollout_config(r)
        while len(kept) < target:
            if len(pending) < target - len(kept):
                pulls += 1
                if pulls > 100:
                    raise UserError(
                        f"the dynamic sampling filter kept {len(kept)} of {target} groups after 100 "
                        "batches; loosen --dynamic-sampling-filter-path or raise --over-sampling-batch-size.",
                        option="--dynamic-sampling-filter-path",
                    )
                # One task per group, all created before any runs: the engine client sends the whole
                # draw's requests to the engine together.
                for g in self.data_source.get_samples(r.over_sampling_batch_size, d.n_samples_per_prompt):
                    if self.cfg.asynchrony.partial_rollout:
                        key = "rollout/partial_continued_samples"
                        counts[key] = counts.get(key, 0.0) + sum(s.response_length > 0 and s.status in _TO_GENERATE for s in g)
                    drawn += 1
                    task = self._group(g, rollout_id=rollout_id, purpose=f"train{pulls}", params=params, rid=f"{prefix}{drawn:06d}-")
                    pending[asyncio.ensure_future(task)] = (drawn, g)
                continue
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in sorted(done, key=lambda t: pending[t][0]):
                order, g = pending.pop(task)  # g: the drawn samples, given back as fresh prompts if not kept
                samples, n = task.result()
                tokens += n
                if len(kept) == target:  # finished together with the last needed group: not needed
                    spare.append((order, g))
                    continue
                if self.dynamic_filter is not None:
                    verdict = apply_group_filter(self.dynamic_filter, self.cfg.reward, samples)
                    if not verdict.keep:
                        key = f"rollout/dynamic_filter/drop_{verdict.reason}"  # upstream miles' name
                        counts[key] = counts.get(key, 0.0) + 1
                        continue
                kept.append((order, samples))
        if pending:  # enough groups: stop the rest now (upstream aborts; the groups go back to the buffer)
            await self.client.abort(prefix)
            if self.cfg.rollout.custom_agent_function_path:  # the agent's own cleanup (its `abort` hook)
                from miles.rollout.generate_hub.agentic_tool_call import call_abort_hook

                await call_abort_hook(self.cfg.rollout.custom_agent_function_path, self.cfg)
            await asyncio.wait(pending, timeout=60)
            for task in pending:
                if task.done() and not task.cancelled():
                    task.exception()  # retrieved: an aborted group's error (if any) is not news
                else:
                    task.cancel()
            spare.extend(pending.values())
        counts["rollout/aborted_groups"] = float(len(pending))
        if spare:  # drawn but not needed: they come back first next time, as fresh prompts (or, partial, as they are)
            back = _as_partial if self.cfg.asynchrony.partial_rollout else _as_fresh
            self.data_source.add_samples([[back(s) for s in g] for _, g in sorted(spare, key=lambda x: x[0])])
            if self.cfg.asynchrony.partial_rollout:
                counts["rollout/partial_aborted_samples"] = float(sum(s.status == SampleStatus.ABORTED and s.response_length > 0 for _, g in spare for s in g))
        return [g for _, g in sorted(kept, key=lambda x: x[0])], counts, tokens

    async def _rollout_fn(self, rollout_id: int) -> tuple[list[list[Sample]], dict[str, float], int]:
        """--rollout-function-path's groups (scored where they have no reward), its metrics, generated tokens."""
        params = SamplingParams.from_rollout_config(self.cfg.rollout)
        prefix = f"train-{rollout_id:06d}-"

        async def generate(sample: Sample, rid: str | None = None) -> list[Sample]:
            # purpose "train1": the seeds of the built-in rollout's first draw
            rid = f"{prefix}s{sample.index or 0:06d}-" if rid is None else rid
            return await self._generate_sample(sample, rollout_id=rollout_id, purpose="train1", params=params, rid=rid)

        out = await self.rollout_fn(
            RolloutFnInput(
                rollout_id=rollout_id, data_source=self.data_source, engine=self.client, cfg=self.cfg,
                tokenizer=self.tokenizer, sampling_params=params, generate=generate,
            )
        )
        await self.client.abort(prefix)  # what the function left running is not waited for
        groups, metrics = as_groups(out, flag=ROLLOUT_FLAG)
        await asyncio.gather(*(self._score_group(g) for g in groups))
        return groups, metrics, sum(s.response_length for g in groups for s in g)

    def generate_split(self, rollout_id: int) -> tuple[dict[str, Any], dict[str, float]]:
        """`generate` as (train data, metrics): the driver calls it with `num_returns=2`, so the train
        data stays in Ray's object store and goes to the training workers as a reference; the driver
        reads only the metrics."""
        out = self.generate(rollout_id)
        return out["train_data"], out["metrics"]

    def generate(self, rollout_id: int) -> dict[str, Any]:
        """One rollout step: `--rollout-batch-size` scored groups as train data, plus rollout/* metrics."""
        d, a = self.cfg.data, self.cfg.asynchrony
        t0 = time.perf_counter()
        if a.train_async:
            # The data position before this rollout drew anything: what a checkpoint of the step before
            # must hold when this rollout is already under way (the overlapped driver saves it).
            self._state_before[rollout_id] = self.state_dict()
            self._state_before.pop(rollout_id - 2, None)
        if a.fully_async:
            if self._async_worker is None:  # started by the first step, after a resume loaded the data position
                from miles.ray.fully_async import AsyncRolloutWorker

                self._async_worker = AsyncRolloutWorker(self, _as_fresh)
            kept, counts, tokens = self._async_worker.take(rollout_id)
        else:
            kept, counts, tokens = self._run(self._collect(rollout_id) if self.rollout_fn is None else self._rollout_fn(rollout_id))
        samples = [s for g in kept for s in g]
        if len(samples) != d.rollout_batch_size * d.n_samples_per_prompt:
            flag = GENERATE_FLAG if self.rollout_fn is None else ROLLOUT_FLAG
            raise UserError(
                f"{flag} made {len(samples)} samples for rollout {rollout_id}; the optimizer steps take exactly "
                f"--rollout-batch-size x --n-samples-per-prompt = {d.rollout_batch_size * d.n_samples_per_prompt}.",
                option=flag,
            )
        train_data = samples_to_train_data(
            samples,
            algo=self.cfg.algo,
            n_samples_per_prompt=d.n_samples_per_prompt,
            reward_key=self.cfg.reward.reward_key,
            custom_reward_post_process=self.reward_post_process,
            custom_convert=self.custom_convert,
            hook_args=self.cfg,
        )
        teacher_metrics = {}
        if self.teacher is not None:
            t_teacher = time.perf_counter()
            lps = train_data["teacher_log_probs"] = self.teacher.score(train_data["tokens"], train_data["response_lengths"])
            n = sum(len(x) for x in lps)
            teacher_metrics = {"rollout/teacher_log_probs": sum(map(sum, lps)) / max(n, 1),
                               "perf/opd_teacher_time": time.perf_counter() - t_teacher}
        elapsed = time.perf_counter() - t0
        raw = torch.tensor(train_data["raw_reward"], dtype=torch.float64)
        sizes = [len(g) for g in kept]
        if any(n != d.n_samples_per_prompt for n in sizes):  # a custom function's groups
            group_std = torch.stack([x.std(unbiased=False) for x in raw.split(sizes)])
        elif d.n_samples_per_prompt > 1:
            group_std = raw.view(-1, d.n_samples_per_prompt).std(dim=1, unbiased=False)
        else:
            group_std = torch.zeros(1)
        lengths = torch.tensor([s.response_length for s in samples], dtype=torch.float64)
        metrics = {
            "rollout/raw_reward": raw.mean().item(),
            "rollout/reward_std": raw.std(unbiased=False).item(),
            "rollout/response_len_mean": lengths.mean().item(),
            "rollout/truncated_ratio": sum(s.status == SampleStatus.TRUNCATED for s in samples) / len(samples),
            "rollout/zero_std_fraction": (group_std <= 1e-8).double().mean().item(),
            "perf/rollout_time": elapsed,
            "perf/rollout_tokens_per_s": tokens / elapsed if elapsed > 0 else 0.0,
            **counts,
            **turn_metrics(samples, "rollout"),
            **teacher_metrics,
        }
        if self.cfg.algo.loss_type == "sft_loss":  # the data's conversations: nothing was generated or rewarded
            for key in ("rollout/raw_reward", "rollout/reward_std", "rollout/zero_std_fraction", "rollout/truncated_ratio",
                        "perf/rollout_tokens_per_s"):
                metrics.pop(key)
        if a.overlapped or a.partial_rollout:
            metrics.update(staleness_metrics(samples, rollout_id))
        health = self.engine.health()
        if "restarts" in health:  # engine servers
            metrics["rollout/engine_restarts"] = float(health["restarts"])
            metrics["rollout/requeued_requests"] = float(health["requeued"])
        if self.cfg.debug.save_debug_rollout_data:
            path = Path(self.cfg.debug.save_debug_rollout_data.format(rollout_id=rollout_id))
            path.parent.mkdir(parents=True, exist_ok=True)
            with path.open("w") as f:
                for s in samples:
                    f.write(json.dumps(s.to_dict()) + "\n")
        return {"train_data": train_data, "metrics": metrics}

    # ------------------------------------------------------------------ eval
    def _binary_rewards(self, samples: list[Sample]) -> bool:
        """True when every sample is scored by a right/wrong reward type (miles.config.reward.BINARY_RM_TYPES)."""
        from miles.config.reward import BINARY_RM_TYPES, split_rm_type
        from miles.rollout.rm_hub import effective_rm_type

        if self.cfg.reward.custom_rm_path:
            return False
        return all(split_rm_type(effective_rm_type(self.cfg.reward, s))[1] in BINARY_RM_TYPES for s in samples)

    async def _eval_groups(self, groups: list[list[Sample]], **kw: Any) -> list[list[Sample]]:
        """Generate every eval group at once, then score each: the samples made of them."""
        out = await asyncio.gather(*(self._generate_group(g, evaluation=True, **kw) for g in groups))
        await asyncio.gather(*(self._score_group(g) for g in out))
        return list(out)

    def eval(self, rollout_id: int) -> dict[str, float]:
        """Score every eval dataset with the eval sampling settings; eval/<name>/{reward,accuracy,...}
        (accuracy only when the reward is right/wrong, see `_binary_rewards`)."""
        e = self.cfg.eval
        metrics: dict[str, float] = {}
        for name, dataset in self.eval_datasets.items():
            t0 = time.perf_counter()
            groups = []
            for i, prompt in enumerate(dataset):
                group = []
                for j in range(e.n_samples_per_eval_prompt):
                    s = Sample.from_dict(prompt.to_dict())
                    s.index = i * e.n_samples_per_eval_prompt + j
                    s.group_index = i
                    group.append(s)
                groups.append(group)
            params = dataclasses.replace(
                SamplingParams.from_rollout_config(self.cfg.rollout),
                temperature=e.eval_temperature,
                top_p=e.eval_top_p,
                top_k=e.eval_top_k,
                max_new_tokens=e.eval_max_response_len,
            )
            groups = self._run(self._eval_groups(groups, rollout_id=rollout_id, purpose=f"eval:{name}", params=params))
            flat = [s for g in groups for s in g]
            key = self.cfg.reward.eval_reward_key
            rewards = [s.get_reward_value(key) for s in flat]
            metrics[f"eval/{name}/reward"] = sum(rewards) / len(rewards)
            if self._binary_rewards(flat):  # "reward > 0" means "correct" only for right/wrong rewards
                metrics[f"eval/{name}/accuracy"] = sum(r > 0 for r in rewards) / len(rewards)
            metrics[f"eval/{name}/response_len_mean"] = sum(s.response_length for s in flat) / len(flat)
            metrics.update(turn_metrics(flat, f"eval/{name}"))
            metrics[f"eval/{name}/truncated_ratio"] = sum(s.status == SampleStatus.TRUNCATED for s in flat) / len(flat)
            metrics["perf/eval_time"] = metrics.get("perf/eval_time", 0.0) + time.perf_counter() - t0
        return metrics

    # ------------------------------------------------------------------ weights
    def begin_weight_update(self) -> WeightTargets:
        """Pause (in-flight requests abort), flush, open the update session on every engine; returns
        where the trainer sends the weights (typed targets, miles/ray/weight_sync.py)."""
        if not hasattr(self.engine, "weight_targets"):  # the in-process engine takes tensors
            self.engine.pause_generation()
            self.engine.begin_weight_update()
            node = current_node_id()
            if node and self._bucket_channel is None:  # a Ray actor: trainer ranks on this node may use it
                self._bucket_channel = BucketChannel(self.load_weight_bucket)
            return InProcessTargets(node_id=node, address=self._bucket_channel.address if self._bucket_channel else "")
        self.engine.begin_weight_update()
        r = self.cfg.rollout
        tp = engine_tp_size(self.cfg)
        # Colocated on GPUs, engine i's TP rank t shares bundle i·tp + t, and so the GPU, with training rank i·tp + t.
        colocated = self.cfg.cluster.colocate and pick_device(self.cfg.cluster.device) == "cuda"
        engines = tuple(
            EngineTarget(url, tp, tuple(range(i * tp, (i + 1) * tp)) if colocated else ())
            for i, url in self.engine.weight_targets()
        )
        return transport_targets(
            r.update_weight_transfer_mode, engines, disk_dir=str(Path(self.log_dir or ".") / "weight_sync"), hf_checkpoint=r.hf_checkpoint
        )

    def load_weight_bucket(
        self, bucket: list[tuple[str, torch.Tensor]] | str | SharedBucket, opens: bool = False, closes_at: int | None = None
    ) -> None:
        """One bucket into the in-process engine: (name, tensor) pairs; a `SharedBucket` in the sender's
        shared-memory buffer (a trainer on this node), whose segment stays mapped from one sync to the
        next; or handles to it (`tensor_ipc.serialize_bucket`), mapped, copied from and let go.
        `opens`: begin the update first (as `begin_weight_update`); `closes_at`: end it afterwards at
        that version (as `end_weight_update`), so a one-bucket sync is this one call."""
        if opens:
            self.begin_weight_update()
        if isinstance(bucket, SharedBucket):
            if self._shared_weights is None:
                self._shared_weights = SharedBucketReader()
            bucket = self._shared_weights.views(bucket)
        elif isinstance(bucket, str):
            from miles.rollout.engine.tensor_ipc import deserialize_payload

            bucket = deserialize_payload(bucket)
        self.engine.update_weights_from_tensors(bucket)
        if closes_at is not None:
            self.end_weight_update(closes_at)

    def end_weight_update(self, version: int) -> None:
        self.engine.end_weight_update(version)
        if not hasattr(self.engine, "weight_targets"):
            self.engine.continue_generation()

    def update_weights(self, buckets: list[list[tuple[str, torch.Tensor]]], version: int) -> None:
        """All buckets in one call (in-process use, e.g. `miles eval` loading a checkpoint)."""
        self.begin_weight_update()
        for bucket in buckets:
            self.load_weight_bucket(bucket)
        self.end_weight_update(version)

    def offload(self, tags: list[str] | None = None) -> None:
        """--offload-rollout: release the engines' memory of `tags` (None: weights, KV cache and CUDA
        graphs) while the trainer runs; engine servers are drained first and their health monitor
        stands down until everything is resumed. No-op on CPU for the built-in engine."""
        self.engine.release_memory_occupation(tags)

    def onload(self, tags: list[str] | None = None) -> None:
        """Take the memory of `tags` back (None: all). Colocated, the order is onload(["weights"]),
        the weight sync, then onload(["kv_cache", "cuda_graph"]): the KV cache is not allocated while
        the weights arrive."""
        self.engine.resume_memory_occupation(tags)

    def weights_checksum(self) -> str:
        return self.engine.get_weights_checksum()

    def recover_engines(self) -> bool:
        """After a failed weight update: True when the engines were recovered and the update may run
        again (fault tolerance); raises RunStopped naming a dead engine otherwise; False in-process."""
        return self.engine.recover()

    def engine_health(self) -> dict[str, Any]:
        return self.engine.health()

    def shutdown(self) -> None:
        """Stop engine servers and the router (no-op for the in-process engine)."""
        if self._async_worker is not None:
            self._async_worker.stop()
        if self._bucket_channel is not None:
            self._bucket_channel.close()
        self.engine.shutdown()
        if self._loop is not None and not self._loop.is_closed():
            self._loop.run_until_complete(self._loop.shutdown_default_executor())
            self._loop.close()

    # ------------------------------------------------------------------ checkpoint state
    def state_dict(self, before_rollout: int | None = None) -> dict[str, Any]:
        """The data position now, or (overlapped drivers) the one saved when rollout `before_rollout` began
        drawing: a checkpoint taken while that rollout is under way then re-generates it on resume."""
        if before_rollout is not None and before_rollout in self._state_before:
            return self._state_before[before_rollout]
        if self._async_worker is not None:
            return {"data_source": self._async_worker.state_dict()}
        return {"data_source": self.data_source.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.data_source.load_state_dict(state["data_source"])
