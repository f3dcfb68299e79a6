"""Where one step of the default run goes: the phases of a GRPO step, timed in one process and in the real loop.

    python bench/step_phases.py                   # 20 steps of the tiny recipe's shape, after 3 warm-ups
    python bench/step_phases.py --run runs/tiny-qwen3/metrics.jsonl   # also split a real run's steps
    python bench/step_phases.py --tiny            # 2 steps (the smoke test)

In-process part (no Ray; the recipe's SFT warm start, prepared in a temporary folder, or `--work`):
the built-in engine generates the recipe's rollout (32 prompts x 8 samples, at most 4 new tokens,
temperature 0.8, per-request seeds, log-probs returned); the reward is the decode + exact match of
`--rm-type exact_match`; group-normalised advantages; then `TorchBackend.train_step` with the recipe's
optimizer settings, split into old log-probs (the no-grad pass before the optimizer step),
forward+backward, and `optimizer.step`; weights handed to the engine (`update_weights`) last.

Real-loop part (`--run METRICS.JSONL`, e.g. the default `miles full-train`'s): the same step as the
driver sees it, from the run's `perf/*` metrics: rollout (generation + reward + the manager's work),
the trainer's own time, the Ray hop around it (train wait minus trainer time: argument transfer,
result return), weight sync, and the rest of the step (the generate call's Ray hop, logging, the
driver), plus the interval between step ends (everything the loop does). Medians over steps without eval or save. `--json` writes both for bench/run_all.py.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path


def prepare(work: Path, tiny: bool) -> dict:
    from miles.prepare.runner import run_prepare_steps
    from recipes import tiny_qwen3

    opts = tiny_qwen3.Options(output_dir=str(work / "runs"), model_dir=str(work / "models"), data_dir=str(work / "data"),
                              sft_steps=2 if tiny else 375)
    plan = tiny_qwen3.plan(opts)
    run_prepare_steps(plan.prepare)
    return plan.engine


def in_process(engine_cfg: dict, steps: int, warmup: int) -> dict[str, float]:
    import random

    import torch
    from transformers import AutoTokenizer

    from miles.backends.torch import TorchBackend
    from miles.config.algo import AlgoConfig
    from miles.config.engine import EngineConfig
    from miles.config.optimizer import OptimizerConfig
    from miles.rollout.engine.base import GenerateRequest, SamplingParams
    from miles.rollout.engine.builtin import BuiltinEngine

    torch.set_num_threads(1)
    hf = engine_cfg["hf_checkpoint"]
    tok = AutoTokenizer.from_pretrained(hf)
    rows = [json.loads(x) for x in Path(engine_cfg["prompt_data"]).read_text().splitlines() if x.strip()]
    n_prompts, n_samples = engine_cfg["rollout_batch_size"], engine_cfg["n_samples_per_prompt"]
    engine = BuiltinEngine(hf, max_batch_size=n_prompts * n_samples, seed=0)
    cfg = EngineConfig()
    cfg.rollout.hf_checkpoint = hf
    cfg.rollout.rollout_temperature = engine_cfg["rollout_temperature"]  # trainer scores at the rollout temperature
    cfg.train.micro_batch_size = engine_cfg["micro_batch_size"]
    cfg.train.deterministic_mode = False
    cfg.data.global_batch_size = n_prompts * n_samples
    cfg.data.num_steps_per_rollout = 1
    cfg.data.n_samples_per_prompt = n_samples
    cfg.optimizer = OptimizerConfig(lr=engine_cfg["lr"], clip_grad=engine_cfg["clip_grad"], seed=0)
    cfg.algo = AlgoConfig(eps_clip_high=0.2)
    trainer = TorchBackend(cfg, rank=0, world_size=1, device="cpu")
    phases: dict[str, list[float]] = {}
    clock: dict[str, float] = {}

    def timed(obj, name: str, key: str) -> None:
        inner = getattr(obj, name)

        def wrapper(*a, **k):
            t = time.perf_counter()
            try:
                return inner(*a, **k)
            finally:
                clock[key] = clock.get(key, 0.0) + time.perf_counter() - t

        setattr(obj, name, wrapper)

    # The RL step's phases (miles/train/step.py looks fill_policy_inputs up in its own namespace).
    import miles.train.step as rl_step

    timed(rl_step, "fill_policy_inputs", "old log-probs + advantages")
    timed(trainer.optimizer, "step", "optimizer step")
    rng = random.Random(0)
    for step in range(warmup + steps):
        clock.clear()
        batch = rng.sample(rows, n_prompts)
        prompts = [list(tok(r["input"], add_special_tokens=False)["input_ids"]) for r in batch]
        reqs = [GenerateRequest(prompts[i // n_samples], SamplingParams(temperature=engine_cfg["rollout_temperature"],
                max_new_tokens=engine_cfg["rollout_max_response_len"], seed=step * 10_000 + i), return_logprob=True)
                for i in range(n_prompts * n_samples)]
        t0 = time.perf_counter()
        out = engine.generate(reqs)
        t1 = time.perf_counter()
        texts = tok.batch_decode([o.output_ids for o in out], skip_special_tokens=True)
        rewards = [1.0 if t.strip() == str(batch[i // n_samples]["label"]).strip() else 0.0 for i, t in enumerate(texts)]
        t2 = time.perf_counter()
        g = torch.tensor(rewards).view(n_prompts, n_samples)
        adv = ((g - g.mean(1, keepdim=True)) / (g.std(1, keepdim=True) + 1e-6)).view(-1).tolist()
        data = {"tokens": [reqs[i].input_ids + list(o.output_ids) for i, o in enumerate(out)],
                "response_lengths": [len(o.output_ids) for o in out], "rewards": adv,
                "loss_masks": [[1] * len(o.output_ids) for o in out],
                "rollout_log_probs": [list(o.output_token_logprobs) for o in out]}
        t3 = time.perf_counter()
        rl_step.train_rollout(trainer, data, rollout_id=step)
        t4 = time.perf_counter()
        engine.begin_weight_update()
        engine.update_weights_from_tensors(list(trainer.named_weights_for_sync()))
        engine.end_weight_update(step + 1)
        t5 = time.perf_counter()
        if step < warmup:
            continue
        split = {"generation": t1 - t0, "reward (decode + exact match)": t2 - t1, "advantages + train data": t3 - t2}
        rest = t4 - t3
        for key in ("old log-probs + advantages", "optimizer step"):
            if key in clock:
                split[f"train: {key}"] = clock[key]
                rest -= clock[key]
        split["train: forward + backward (+ loss, clip)" if len(clock) == 2 else "train: train_step"] = rest
        split["weight update (in process)"] = t5 - t4
        for k, v in split.items():
            phases.setdefault(k, []).append(v)
    return {k: statistics.median(v) for k, v in phases.items()}


def real_loop(metrics: Path) -> dict[str, float]:
    merged: dict[int, dict] = {}
    for line in metrics.read_text().splitlines():
        if line.strip():
            r = json.loads(line)  # files written before issue 28 log a step in two records
            merged.setdefault(r["step"], {}).update(r)
    rows = [r for r in merged.values() if "perf/step_time" in r and "perf/eval_time" not in r and r["step"] > 1]
    if not rows:
        raise SystemExit(f"{metrics}: no step without eval after step 1")
    med = {k: statistics.median(r.get(k, 0.0) for r in rows)
           for k in ("perf/step_time", "perf/rollout_time", "perf/train_time", "perf/train_step_time", "perf/weight_sync_time")}
    return {
        "rollout (generation + reward, in the manager)": med["perf/rollout_time"],
        "trainer's train call": med["perf/train_step_time"],
        "Ray hop around the train call": med["perf/train_time"] - med["perf/train_step_time"],
        "weight sync": med["perf/weight_sync_time"],
        "rest (the generate call's Ray hop, logging, driver)": med["perf/step_time"] - med["perf/rollout_time"] - med["perf/train_time"] - med["perf/weight_sync_time"],
        "step": med["perf/step_time"],
        "step interval (between step ends, all included)": statistics.median(
            merged[s]["time"] - merged[s - 1]["time"] for s in (r["step"] for r in rows) if s - 1 in merged and "perf/step_time" in merged[s - 1]),
        "steps counted": float(len(rows)),
    }


def show(title: str, phases: dict[str, float], total: float) -> None:
    print(f"\n{title}")
    for k, v in phases.items():
        if k in ("step", "steps counted") or k.startswith("step interval"):
            continue
        print(f"  {k:48} {v * 1000:8.1f} ms {v / total:6.0%}")
    print(f"  {'total':48} {total * 1000:8.1f} ms")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--run", type=Path, default=None, help="a run's metrics.jsonl to split as well")
    ap.add_argument("--work", type=Path, default=None, help="prepare the recipe's inputs here (kept) instead of a temporary folder")
    ap.add_argument("--tiny", action="store_true", help="2 steps after 1 warm-up, 2-step warm start (the smoke test)")
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()
    steps, warmup = (2, 1) if a.tiny else (a.steps, 3)
    with tempfile.TemporaryDirectory(prefix="miles-phases-") as tmp:
        work = a.work or Path(tmp)
        cfg = prepare(work, a.tiny)
        phases = in_process(cfg, steps, warmup)
    total = sum(phases.values())
    show(f"one step in process (median of {steps}; torch threads 1)", phases, total)
    result = {"bench": "step_phases", "in_process": phases, "rows": [
        {"what": "in-process step: train share", "value": sum(v for k, v in phases.items() if k.startswith("train")) / total,
         "unit": "of step", "goal": "", "met": None}]}
    if a.run:
        loop = real_loop(a.run)
        show(f"one step of the real loop ({a.run}; median of {loop['steps counted']:.0f} steps)", loop, loop["step"])
        print(f"  {'step interval (between step ends, all included)':48} {loop['step interval (between step ends, all included)'] * 1000:8.1f} ms")
        result["real_loop"] = loop
    if a.json:
        a.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
