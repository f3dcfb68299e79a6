"""The rollout manager: prompts → engines → rewards → train data, and eval, behind one object.

It owns the rollout engine (made by `miles.rollout.engine.factory.make_engine` from --rollout-backend:
the built-in engine in-process, or a fleet of engine servers behind sglang-router with
--rollout-num-gpus), the prompt data source, the eval datasets and the reward settings. The driver
runs it as one Ray actor and talks to it only through the methods below; it can also be used
in-process (tests).

Generation is per request and asynchronous. A training rollout submits whole prompt groups, scores
each group as soon as its last sample is back and applies the dynamic-sampling filter to it; while
fewer groups are in flight than are still missing it draws --over-sampling-batch-size more (upstream's
group-level rule). Once --rollout-batch-size groups are kept, the groups still in flight are aborted
and go back to the data source, first in line for the next step. Kept groups are put in the order
they were drawn, so a run without over-sampling is reproducible whatever order requests finish in.

Sampling is reproducible without saving engine RNG state: every request carries its own seed derived
from (--rollout-seed, rollout id, sample index), so a resumed run regenerates exactly what an
uninterrupted run would have.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import json
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch

from miles.config.engine import EngineConfig
from miles.errors import UserError
from miles.rollout.data_source import PromptDataset, RolloutDataSource
from miles.rollout.engine.base import GenerateRequest, GenerateResponse, SamplingParams
from miles.rollout.engine.factory import make_engine
from miles.rollout.filters import apply_group_filter, load_group_filter
from miles.rollout.rm_hub import compute_group_rewards
from miles.rollout.train_data import samples_to_train_data
from miles.sample import Sample, SampleStatus
from miles.utils.load_function import load_function


def request_seed(base: int, rollout_id: int, index: int, *, purpose: str = "train") -> int:
    digest = hashlib.sha256(f"{purpose}:{base}:{rollout_id}:{index}".encode()).digest()
    return int.from_bytes(digest[:4], "little")


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


def staleness_metrics(samples: list[Sample], current_version: int) -> dict[str, float]:
    """rollout/weight_staleness_{mean,max}: per sample, the trainer's weight version when it trains the
    sample (rollout r trains on version r, the weights after r updates) minus the oldest version among its
    tokens: 0 in the synchronous loop, 1 with one-step overlap."""
    lags = [current_version - min(v) for v in ([x for x in s.weight_versions or [] if x is not None] for s in samples) if v]
    if not lags:
        return {}
    return {"rollout/weight_staleness_mean": sum(lags) / len(lags), "rollout/weight_staleness_max": float(max(lags))}


def engine_tp_size(cfg: EngineConfig) -> int:
    """Processes (TP ranks) per engine server: SGLang's --tp-size, 1 for the built-in engine server."""
    if cfg.rollout.rollout_backend != "sglang":
        return 1
    from miles.rollout.sglang.launch import engine_layout

    return engine_layout(cfg).gpus_per_engine


def when_all(futures: list[Future]) -> asyncio.Future:
    """An asyncio future of the results of `futures` (concurrent futures, e.g. engine requests), in
    order, or the first error. The event loop wakes once, when the last one is done, instead of once
    per request as `asyncio.gather(*map(asyncio.wrap_future, futures))` would: each wake-up takes the
    GIL from the engine's scheduler thread while it generates."""
    loop = asyncio.get_running_loop()
    out: asyncio.Future = loop.create_future()
    left = [len(futures)]
    lock = threading.Lock()

    def settle() -> None:
        if out.done():  # cancelled meanwhile (an aborted draw), or already failed
            return
        for f in futures:
            if f.done() and (f.cancelled() or f.exception() is not None):
                out.set_exception(asyncio.CancelledError() if f.cancelled() else f.exception())
                return
        out.set_result([f.result() for f in futures])

    def one_done(f: Future) -> None:
        with lock:
            left[0] -= 1
            last = left[0] == 0
        if last or f.cancelled() or f.exception() is not None:  # an error is reported at once
            loop.call_soon_threadsafe(settle)

    if not futures:
        out.set_result([])
    for f in futures:
        f.add_done_callback(one_done)
    return out


def pick_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda was given but no CUDA device is visible; use --device cpu or auto.", option="--device")
    return device


class RolloutManager:
    def __init__(
        self,
        cfg: EngineConfig,
        *,
        threads: int = 1,
        train_data: bool = True,
        engine_actor_options: list[dict[str, Any]] | None = None,
        log_dir: str | None = None,
    ):
        torch.set_num_threads(threads)
        self.cfg = cfg
        r, d = cfg.rollout, cfg.data
        self.log_dir = log_dir
        self.engine = make_engine(cfg, device=pick_device(cfg.cluster.device), actor_options=engine_actor_options, log_dir=log_dir)
        self.tokenizer = getattr(self.engine, "tokenizer", None)
        if self.tokenizer is None:  # engine servers: the manager still tokenizes prompts itself
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(r.hf_checkpoint, local_files_only=True)
        if train_data:  # `miles eval` needs only the eval datasets
            self.dataset = PromptDataset.from_config(d, r, self.tokenizer)
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
            )
        self.dynamic_filter = load_group_filter(r.dynamic_sampling_filter_path)
        self._state_before: dict[int, dict[str, Any]] = {}
        self._async_worker = None  # --fully-async: miles.ray.fully_async.AsyncRolloutWorker
        rw = cfg.reward
        self.reward_post_process = load_function(rw.custom_reward_post_process_path, flag="--custom-reward-post-process-path")
        self.custom_convert = load_function(rw.custom_convert_samples_to_train_data_path, flag="--custom-convert-samples-to-train-data-path")

    # ------------------------------------------------------------------ generation
    def num_prompts(self) -> int:
        return len(self.dataset)

    def _request(self, s: Sample, *, rollout_id: int, purpose: str, params: SamplingParams, rid: str | None = None) -> GenerateRequest:
        """The request for one sample. Each request gets its own seed (from --rollout-seed, the rollout
        id and the sample index), and its new tokens are capped so prompt + response stay within
        --rollout-max-context-len."""
        context = self.cfg.rollout.rollout_max_context_len
        if s.response_length > 0:  # --partial-rollout: continue the response from all its tokens
            prompt_ids = list(s.tokens)
            params = dataclasses.replace(params, max_new_tokens=max(0, params.max_new_tokens - s.response_length))
        elif s.tokens and s.response_length == 0:
            # The prompt's ids, tokenized once when the dataset was read (PromptDataset keeps them):
            # re-encoding the same prompt for each of its samples every step was a tenth of a step.
            prompt_ids = list(s.tokens)
        else:
            prompt_ids = self.tokenizer.encode(s.prompt, add_special_tokens=False)
            s.tokens = list(prompt_ids)
        max_new = params.max_new_tokens if context is None else max(0, min(params.max_new_tokens, context - len(prompt_ids)))
        seed = request_seed(self.cfg.rollout.rollout_seed, rollout_id, s.index or 0, purpose=purpose)
        return GenerateRequest(
            input_ids=prompt_ids,
            sampling_params=dataclasses.replace(params, max_new_tokens=max_new, seed=seed),
            return_logprob=True,
            rid=rid,
        )

    def _fill(self, s: Sample, resp: GenerateResponse) -> int:
        """Append the response to `s` (after what a partial rollout generated earlier); returns new tokens."""
        new = len(resp.output_ids)
        earlier = s.response_length  # > 0 only for a continued partial rollout
        s.tokens = s.tokens + list(resp.output_ids)
        s.response_length = earlier + new
        s.response = (s.response if earlier else "") + resp.text
        logprobs = [float(x) for x in (resp.output_token_logprobs or [])]
        s.rollout_log_probs = (s.rollout_log_probs or [])[:earlier] + logprobs if earlier else logprobs
        s.weight_versions = (s.weight_versions or [])[:earlier] + [resp.weight_version] * new if earlier else [resp.weight_version] * new
        finish = resp.finish_reason["type"]
        s.status = {"stop": SampleStatus.COMPLETED, "length": SampleStatus.TRUNCATED}.get(finish, SampleStatus.ABORTED)
        s.weight_version = resp.weight_version
        a = self.cfg.asynchrony
        if earlier and a.mask_offpolicy_in_partial_rollout and s.status != SampleStatus.ABORTED:
            # Only the tokens of the weights that finished the response are on-policy for this step.
            s.loss_mask = [int(v == resp.weight_version) for v in s.weight_versions]
        return new

    def _submit(self, samples: list[Sample], *, rollout_id: int, purpose: str, params: SamplingParams, rid: str | None = None) -> list:
        """Submit one request per sample; returns their futures."""
        reqs = [
            self._request(s, rollout_id=rollout_id, purpose=purpose, params=params, rid=None if rid is None else f"{rid}{j:04d}")
            for j, s in enumerate(samples)
        ]
        return [self.engine.submit(q) for q in reqs]

    async def _fill_all(self, samples: list[Sample], futures: list) -> int:
        """Wait for `futures` and fill `samples` (in place) with their responses; returns tokens."""
        responses = await when_all(futures)
        return sum(self._fill(s, resp) for s, resp in zip(samples, responses))

    async def _run(self, samples: list[Sample], *, rollout_id: int, purpose: str, params: SamplingParams, rid: str | None = None) -> int:
        """Generate `samples` (in place) through the engine, all requests in flight at once; returns tokens."""
        with self._submitting():
            futures = self._submit(samples, rollout_id=rollout_id, purpose=purpose, params=params, rid=rid)
        return await self._fill_all(samples, futures)

    def _submitting(self):
        """Context in which submitted requests reach the engine's scheduler together (one batch) rather
        than a few at a time as the scheduler wakes up between them; engines without a scheduler of
        their own (servers behind a router) need nothing."""
        together = getattr(self.engine, "submitting_together", None)
        return together() if together is not None else contextlib.nullcontext()

    def _generate(self, samples: list[Sample], *, rollout_id: int, purpose: str, params: SamplingParams) -> int:
        """Fill `samples` in place with responses; return the number of generated tokens."""
        return asyncio.run(self._run(samples, rollout_id=rollout_id, purpose=purpose, params=params))

    def _score(self, groups: list[list[Sample]]) -> None:
        async def score_all():
            results = await asyncio.gather(*(compute_group_rewards(self.cfg.reward, g) for g in groups))
            for g, rewards in zip(groups, results):
                for s, reward in zip(g, rewards):
                    s.reward = reward

        asyncio.run(score_all())

    async def _group(self, group: list[Sample], futures: list, *, todo: list[Sample] | None = None) -> int:
        """Wait for one submitted prompt group (its samples `todo` were submitted) and score it."""
        tokens = await self._fill_all(group if todo is None else todo, futures)
        for s, reward in zip(group, await compute_group_rewards(self.cfg.reward, group)):
            s.reward = reward
        return tokens

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
                groups = self.data_source.get_samples(r.over_sampling_batch_size, d.n_samples_per_prompt)
                # A partial rollout's finished samples are not generated again, its aborted ones continue.
                todo = [[s for s in g if s.status in _TO_GENERATE] for g in groups]
                if self.cfg.asynchrony.partial_rollout:
                    key = "rollout/partial_continued_samples"
                    counts[key] = counts.get(key, 0.0) + sum(s.response_length > 0 for t in todo for s in t)
                with self._submitting():  # the whole draw is submitted before the scheduler looks
                    futures = [
                        self._submit(t, rollout_id=rollout_id, purpose=f"train{pulls}", params=params, rid=f"{prefix}{drawn + k + 1:06d}-")
                        for k, t in enumerate(todo)
                    ]
                for g, t, f in zip(groups, todo, futures):
                    drawn += 1
                    pending[asyncio.ensure_future(self._group(g, f, todo=t))] = (drawn, g)
                continue
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in sorted(done, key=lambda t: pending[t][0]):
                order, g = pending.pop(task)
                tokens += task.result()
                if len(kept) == target:  # finished together with the last needed group: not needed
                    spare.append((order, g))
                    continue
                if self.dynamic_filter is not None:
                    verdict = apply_group_filter(self.dynamic_filter, self.cfg.reward, g)
                    if not verdict.keep:
                        key = f"rollout/dynamic_filter/drop_{verdict.reason}"  # upstream miles' name
                        counts[key] = counts.get(key, 0.0) + 1
                        continue
                kept.append((order, g))
        if pending:  # enough groups: stop the rest now (upstream aborts; the groups go back to the buffer)
            await asyncio.get_running_loop().run_in_executor(None, lambda: self.engine.abort_request(prefix))
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
            # must hold when this rollout is already under way (the overlapped drivers save it).
            self._state_before[rollout_id] = self.state_dict()
            self._state_before.pop(rollout_id - 2, None)
        if a.fully_async:
            if self._async_worker is None:  # started by the first step, after a resume loaded the data position
                from miles.ray.fully_async import AsyncRolloutWorker

                self._async_worker = AsyncRolloutWorker(self, _as_fresh)
            kept, counts, tokens = self._async_worker.take(rollout_id)
        else:
            kept, counts, tokens = asyncio.run(self._collect(rollout_id))
        samples = [s for g in kept for s in g]
        train_data = samples_to_train_data(
            samples,
            algo=self.cfg.algo,
            n_samples_per_prompt=d.n_samples_per_prompt,
            reward_key=self.cfg.reward.reward_key,
            custom_reward_post_process=self.reward_post_process,
            custom_convert=self.custom_convert,
            hook_args=self.cfg,
        )
        elapsed = time.perf_counter() - t0
        raw = torch.tensor(train_data["raw_reward"], dtype=torch.float64)
        group_std = raw.view(-1, d.n_samples_per_prompt).std(dim=1, unbiased=False) if d.n_samples_per_prompt > 1 else torch.zeros(1)
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
        }
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
            flat = [s for g in groups for s in g]
            params = dataclasses.replace(
                SamplingParams.from_rollout_config(self.cfg.rollout),
                temperature=e.eval_temperature,
                top_p=e.eval_top_p,
                top_k=e.eval_top_k,
                max_new_tokens=e.eval_max_response_len,
            )
            self._generate(flat, rollout_id=rollout_id, purpose=f"eval:{name}", params=params)
            self._score(groups)
            key = self.cfg.reward.eval_reward_key
            rewards = [s.get_reward_value(key) for s in flat]
            metrics[f"eval/{name}/reward"] = sum(rewards) / len(rewards)
            if self._binary_rewards(flat):  # "reward > 0" means "correct" only for right/wrong rewards
                metrics[f"eval/{name}/accuracy"] = sum(r > 0 for r in rewards) / len(rewards)
            metrics[f"eval/{name}/response_len_mean"] = sum(s.response_length for s in flat) / len(flat)
            metrics[f"eval/{name}/truncated_ratio"] = sum(s.status == SampleStatus.TRUNCATED for s in flat) / len(flat)
            metrics["perf/eval_time"] = metrics.get("perf/eval_time", 0.0) + time.perf_counter() - t0
        return metrics

    # ------------------------------------------------------------------ weights
    def begin_weight_update(self) -> dict[str, Any]:
        """Pause (in-flight requests abort), flush, open the update session on every engine; returns
        where the trainer's source rank sends the weights (miles/ray/weight_sync.py)."""
        if not hasattr(self.engine, "weight_targets"):  # the in-process engine takes tensors
            self.engine.pause_generation()
            self.engine.begin_weight_update()
            return {"mode": "in_process"}
        self.engine.begin_weight_update()
        r = self.cfg.rollout
        urls = self.engine.weight_targets()
        return {
            "mode": r.update_weight_transfer_mode,
            "urls": urls,
            "tp_sizes": [engine_tp_size(self.cfg)] * len(urls),
            "disk_dir": str(Path(self.log_dir or ".") / "weight_sync"),
            "hf_checkpoint": r.hf_checkpoint,
        }

    def load_weight_bucket(self, bucket: list[tuple[str, torch.Tensor]]) -> None:
        self.engine.update_weights_from_tensors(bucket)

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

    def offload(self) -> None:
        """--offload-rollout: engine weights to host memory while the actors train (no-op on CPU)."""
        self.engine.release_memory_occupation()

    def onload(self) -> None:
        self.engine.resume_memory_occupation()

    def weights_checksum(self) -> str:
        return self.engine.get_weights_checksum()

    def recover_engines(self) -> bool:
        """After a failed weight update: True when the engines were recovered and the update may run
        again (fault tolerance); raises RunStopped naming a dead engine otherwise; False in-process."""
        recover = getattr(self.engine, "recover", None)
        if recover is None:
            return False
        recover()
        return True

    def engine_health(self) -> dict[str, Any]:
        return self.engine.health()

    def shutdown(self) -> None:
        """Stop engine servers and the router (no-op for the in-process engine)."""
        if self._async_worker is not None:
            self._async_worker.stop()
        stop = getattr(self.engine, "shutdown", None)
        if stop is not None:
            stop()

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
