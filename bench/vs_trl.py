"""The RL loop against TRL's `GRPOTrainer`: same model, data, warm start and settings, side by side.

    pip install -e ".[bench]"                       # TRL: a bench-only extra, never a runtime dependency
    python bench/vs_trl.py                          # 150 GRPO steps per side, eval every 25 (~10 min on 2 cores)
    python bench/vs_trl.py --steps 500 --eval-interval 50 --target-acc 0.4
    python bench/vs_trl.py --tiny                   # 3 steps per side: the smoke test's size
    python bench/vs_trl.py --side-by-side           # both sides at once, so both see the same load
    python bench/vs_trl.py --seeds 0 1 2            # the whole comparison once per seed: learning per step, with its spread

What is shared: the tiny recipe's prepared inputs (its random 2-layer Qwen3, the two-digit-addition
task with 200 held-out problems, and the SFT warm start: one directory both sides start from), and
the recipe's RL settings: 32 prompts x 8 samples x at most 4 new tokens per step, temperature 0.8,
lr 3e-4 constant, AdamW (0.9, 0.95, eps 1e-8, no weight decay), grad-norm clip 1.0, PPO clip 0.2,
no KL, group-normalised advantages (mean and std), one optimizer step per rollout, the loss averaged
per sample then over samples (TRL `loss_type="grpo"`), exact-match reward on the decoded answer,
greedy eval of the held-out split every `--eval-interval` steps (and before the first). miles' trainer
and engine are two processes; in the synchronous loop they take turns, and each uses every core while
it computes (miles/ray/threads.py). TRL runs at each setting of
`--trl-threads`: by default first at its own default (torch's thread count, every core: its strongest
setting on an idle machine, and the one the ratios are taken against), then at one thread (its steadiest on
a busy machine), reported too. Settings that cannot be made identical are listed in docs/benchmarks.md.

Each side runs as its own process, launched from here: miles as `miles full-train` (its prepare steps
are already complete, so it goes straight to Ray start-up and GRPO), TRL as this file with `--trl-child`.
Reported per side: median step time (between consecutive step ends; steps with an eval excluded), generated tokens/s
(miles: over the whole rollout, the rollout manager's work included; TRL: inside `model.generate`), peak RSS of the whole process tree (Ray's processes included for miles), start to the end
of the first RL step (eval excluded), and the held-out greedy accuracy against wall time since launch.
After both sides, the built-in engine and `generate` are timed on the rollout's own batch in this
process, generation alone (`engine_vs_generate`): the like-for-like generation row. The ratios come last (> 1 means miles is better). `--json PATH` also writes them for bench/run_all.py.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EVAL_KEY = "eval/arith/accuracy"


@dataclass
class Side:
    name: str
    step_s: list[float] = field(default_factory=list)
    gen_tokens_per_s: list[float] = field(default_factory=list)
    evals: list[tuple[float, int, float]] = field(default_factory=list)  # (seconds since launch, step, accuracy)
    first_step_s: float = float("nan")
    peak_rss: int = 0
    wall_s: float = 0.0

    def time_to(self, acc: float) -> float | None:
        return next((t for t, _, a in self.evals if a >= acc), None)


def prepared_inputs(work: Path, seed: int, sft_steps: int) -> dict:
    """The tiny recipe's prepare steps (model, task, SFT warm start) into `work`; returns its engine settings."""
    from miles.prepare.runner import run_prepare_steps
    from recipes import tiny_qwen3

    opts = tiny_qwen3.Options(output_dir=str(work / "runs"), model_dir=str(work / "models"), data_dir=str(work / "data"),
                              prepare_seed=seed, run_id="vs-trl", sft_steps=sft_steps)
    plan = tiny_qwen3.plan(opts)
    run_prepare_steps(plan.prepare)
    return plan.engine


sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench scripts run as files, not a package
from startup import TreeRss  # noqa: E402 - the process tree's peak RSS, sampled as bench/startup.py does


def launch(cmd: list[str], log: Path, timeout_s: float, env: dict | None = None) -> tuple[float, float, int]:
    """Run `cmd` (output to `log`); returns (launch unix time, wall seconds, peak tree RSS). Raises on failure."""
    launched = time.time()
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=env)
        rss = TreeRss(proc.pid)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise TimeoutError(f"{cmd[2]} did not finish within {timeout_s:.0f} s; log: {log}") from None
        finally:
            peak = rss.stop()
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:4])} exited {proc.returncode}; log: {log}\n{log.read_text()[-3000:]}")
    return launched, time.time() - launched, peak


def run_miles(work: Path, a: argparse.Namespace) -> Side:
    extra = (f"--num-rollout {a.steps} --eval-interval {a.eval_interval} --save-interval {a.steps} "
             f"--rollout-seed {a.seed}")
    cmd = [sys.executable, "-m", "miles_cli.main", "full-train", "--prepare-seed", str(a.seed),
           "--output-dir", str(work / "runs"), "--model-dir", str(work / "models"), "--data-dir", str(work / "data"),
           "--run-id", "vs-trl", "--sft-steps", str(a.sft_steps), "--extra-args", extra]
    launched, wall, peak = launch(cmd, work / "miles.log", a.timeout_s)
    rows = [json.loads(x) for x in (work / "runs" / "vs-trl" / "metrics.jsonl").read_text().splitlines() if x.strip()]
    side = Side("miles", peak_rss=peak, wall_s=wall)
    eval_s_before_first = sum(r.get("perf/eval_time", 0.0) for r in rows if r["step"] == 0)
    # A step's time is the wall time between the records that end it and the step before (as TRL's
    # side measures it, between step ends): everything the loop does counts, logging included, not only
    # the part `perf/step_time` times. Steps with an eval (or the final save) are left out.
    ends = {r["step"]: r["time"] for r in rows if "perf/step_time" in r or r["step"] == 0}  # 0: the eval before training
    evals = {r["step"] for r in rows if "perf/eval_time" in r}
    side.step_s = [ends[s] - ends[s - 1] for s in sorted(ends) if s - 1 in ends and s not in evals]
    for r in rows:
        if "perf/rollout_tokens_per_s" in r:
            side.gen_tokens_per_s.append(r["perf/rollout_tokens_per_s"])
        if EVAL_KEY in r:
            side.evals.append((r["time"] - launched, r["step"], r[EVAL_KEY]))
    first = min(r["time"] for r in rows if r["step"] == 1 and "perf/step_time" in r)
    side.first_step_s = first - launched - eval_s_before_first
    return side


def engine_vs_generate(engine: dict, repeats: int, seed: int) -> tuple[float, float]:
    """Generated tokens/s of the built-in engine and of Hugging Face `generate` on the run's own rollout
    batch, in this process, interleaved: the SFT warm start, `rollout_batch_size` train prompts x
    `n_samples_per_prompt` samples, the rollout temperature, at most `rollout_max_response_len` tokens,
    stopping at eos. The loop's "generated tokens/s" rows do not compare generation with generation:
    miles' `perf/rollout_tokens_per_s` divides by the whole rollout (the rollout manager's per-sample
    work, rewards and train data included), TRL's side by the time inside `model.generate`. Here both
    are timed around generation alone (ours: `engine.generate`, its requests built beforehand; theirs:
    tokenizing the left-padded batch and `generate`), tokens counted up to and including the first eos.
    Returns the medians (ours, generate) after two warm-ups; one torch thread, as the loop's actors."""
    import random

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from miles.rollout.engine.base import GenerateRequest, SamplingParams
    from miles.rollout.engine.builtin import BuiltinEngine

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        hf, n_prompts, n_samples = engine["hf_checkpoint"], engine["rollout_batch_size"], engine["n_samples_per_prompt"]
        temperature, max_new = engine["rollout_temperature"], engine["rollout_max_response_len"]
        tok = AutoTokenizer.from_pretrained(hf)
        rows = [json.loads(x) for x in Path(engine["prompt_data"]).read_text().splitlines() if x.strip()]
        ours_engine = BuiltinEngine(hf, max_batch_size=n_prompts * n_samples, seed=seed)
        model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
        rng = random.Random(seed)
        ours, theirs = [], []
        for i in range(repeats + 2):
            prompts = [r["input"] for r in rng.sample(rows, n_prompts)]
            reqs = [GenerateRequest(tok(p, add_special_tokens=False)["input_ids"],
                                    SamplingParams(temperature=temperature, max_new_tokens=max_new, seed=i * 100_000 + k), True)
                    for p in prompts for k in range(n_samples)]
            t = time.perf_counter()
            n_ours = sum(len(r.output_ids) for r in ours_engine.generate(reqs))
            t_ours = time.perf_counter() - t
            t = time.perf_counter()
            batch = tok([p for p in prompts for _ in range(n_samples)], return_tensors="pt", padding=True,
                        padding_side="left", add_special_tokens=False)
            with torch.no_grad():
                out = model.generate(**batch, do_sample=True, temperature=temperature, top_k=0, top_p=1.0, max_new_tokens=max_new,
                                     pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
            t_theirs = time.perf_counter() - t
            new = out[:, batch["input_ids"].shape[1]:]
            is_eos = new == tok.eos_token_id
            first = torch.where(is_eos.any(1), is_eos.int().argmax(1) + 1, torch.full((new.shape[0],), new.shape[1]))
            if i >= 2:
                ours.append(n_ours / t_ours)
                theirs.append(int(first.sum()) / t_theirs)
        return statistics.median(ours), statistics.median(theirs)
    finally:
        torch.set_num_threads(threads)


def trl_side_name(threads: str) -> str:
    return "TRL" if threads == "default" else f"TRL {threads} thread" + ("s" if threads != "1" else "")


def run_trl(work: Path, engine: dict, a: argparse.Namespace, threads: str = "default") -> Side:
    out = work / f"trl-{threads}.json"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--trl-child", json.dumps({
        "model": engine["hf_checkpoint"], "train": engine["prompt_data"], "eval": engine["eval_prompt_data"][1],
        "out": str(out), "work": str(work / f"trl-{threads}"), "threads": threads, "steps": a.steps, "eval_interval": a.eval_interval, "seed": a.seed,
        "engine": {k: engine[k] for k in ("rollout_batch_size", "n_samples_per_prompt", "rollout_max_response_len",
                                          "rollout_temperature", "lr", "clip_grad")}})]
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    env.pop("OMP_NUM_THREADS", None)  # "default": torch picks its own thread count
    if threads != "default":
        env["OMP_NUM_THREADS"] = threads
    launched, wall, peak = launch(cmd, work / f"trl-{threads}.log", a.timeout_s, env=env)
    r = json.loads(out.read_text())
    return Side(trl_side_name(threads), step_s=r["step_s"], gen_tokens_per_s=r["gen_tokens_per_s"],
                evals=[(t - launched, s, acc) for t, s, acc in r["evals"]], first_step_s=r["first_step_end"] - launched - r["eval_s_before_first"],
                peak_rss=peak, wall_s=wall)


def trl_child(spec: dict) -> None:
    """TRL's GRPOTrainer with the recipe's settings; writes step times, generation rates and evals to spec['out']."""
    import torch

    if spec["threads"] != "default":
        torch.set_num_threads(int(spec["threads"]))
    import datasets
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    e = spec["engine"]
    tok = AutoTokenizer.from_pretrained(spec["model"])
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32)
    train = [json.loads(x) for x in Path(spec["train"]).read_text().splitlines() if x.strip()]
    held_out = [json.loads(x) for x in Path(spec["eval"]).read_text().splitlines() if x.strip()]
    assert tok("1+2=")["input_ids"] == tok("1+2=", add_special_tokens=False)["input_ids"], "the tokenizer adds specials"
    data = datasets.Dataset.from_list([{"prompt": r["input"], "label": r["label"]} for r in train])

    def exact_match(completions, label, **_):
        return [1.0 if c.strip() == str(lab).strip() else 0.0 for c, lab in zip(completions, label)]

    record: dict = {"step_s": [], "gen_tokens_per_s": [], "evals": [], "eval_s_before_first": 0.0}
    gen_time = [0.0, 0]
    inner_generate = model.generate

    def timed_generate(*args, **kwargs):
        t = time.perf_counter()
        out = inner_generate(*args, **kwargs)
        gen_time[0] += time.perf_counter() - t
        n_prompt = (kwargs.get("input_ids") if "input_ids" in kwargs else args[0]).shape[1]
        new = out[:, n_prompt:]
        # Tokens up to and including the first eos, as a rollout counts them.
        is_eos = new == tok.eos_token_id
        first = torch.where(is_eos.any(1), is_eos.int().argmax(1) + 1, torch.full((new.shape[0],), new.shape[1]))
        gen_time[1] += int(first.sum())
        return out

    model.generate = timed_generate

    def evaluate() -> float:
        batch = tok([r["input"] for r in held_out], return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.no_grad():
            out = inner_generate(**batch, max_new_tokens=e["rollout_max_response_len"], do_sample=False,
                                 pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
        texts = tok.batch_decode(out[:, batch["input_ids"].shape[1]:], skip_special_tokens=True)
        return sum(t.strip() == str(r["label"]).strip() for t, r in zip(texts, held_out)) / len(held_out)

    class Clock(TrainerCallback):
        def __init__(self):
            self.last = None
            self.evaled = False

        def on_train_begin(self, args, state, control, **kw):
            t = time.perf_counter()
            model.eval()
            record["evals"].append((time.time(), 0, evaluate()))
            model.train()
            record["eval_s_before_first"] = time.perf_counter() - t
            self.last = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            now = time.perf_counter()
            if state.global_step == 1:
                record["first_step_end"] = time.time()
            step_s = now - self.last
            if gen_time[0] > 0:
                record["gen_tokens_per_s"].append(gen_time[1] / gen_time[0])
            gen_time[0], gen_time[1] = 0.0, 0
            if state.global_step % spec["eval_interval"] == 0 or state.global_step == spec["steps"]:
                model.eval()
                record["evals"].append((time.time(), state.global_step, evaluate()))
                model.train()
            else:
                record["step_s"].append(step_s)
            self.last = time.perf_counter()

    n = e["rollout_batch_size"] * e["n_samples_per_prompt"]
    cfg = GRPOConfig(
        output_dir=spec["work"], max_steps=spec["steps"], per_device_train_batch_size=n, num_generations=e["n_samples_per_prompt"],
        steps_per_generation=1, num_iterations=1, max_completion_length=e["rollout_max_response_len"],
        temperature=e["rollout_temperature"], top_p=1.0, top_k=0, learning_rate=e["lr"], lr_scheduler_type="constant",
        warmup_steps=0, adam_beta1=0.9, adam_beta2=0.95, adam_epsilon=1e-8, weight_decay=0.0, max_grad_norm=e["clip_grad"],
        beta=0.0, epsilon=0.2, loss_type="grpo", scale_rewards="group", use_cpu=True, bf16=False, report_to="none",
        save_strategy="no", logging_steps=10 ** 9, seed=spec["seed"], disable_dropout=True, dataloader_num_workers=0,
    )
    trainer = GRPOTrainer(model=model, reward_funcs=exact_match, args=cfg, train_dataset=data, processing_class=tok,
                          callbacks=[Clock()])
    trainer.train()
    Path(spec["out"]).write_text(json.dumps(record))


def summary(sides: list[Side], a: argparse.Namespace, engine_rates: tuple[float, float] | None = None) -> list[dict]:
    """Print the sides' table; return the ratio rows, miles against each TRL side (the first TRL side,
    its default threads, gives the rows' plain names: the goals are set against TRL's strongest setting)."""
    med = {s.name: statistics.median(s.step_s) if s.step_s else float("nan") for s in sides}
    gen = {s.name: statistics.median(s.gen_tokens_per_s) if s.gen_tokens_per_s else float("nan") for s in sides}
    width = 16
    print(f"\n{'':34}" + "".join(f"{s.name:>{width}}" for s in sides))
    print(f"{'median step time (s)':34}" + "".join(f"{med[s.name]:{width}.3f}" for s in sides))
    print(f"{'generated tokens/s (median)':34}" + "".join(f"{gen[s.name]:{width}.0f}" for s in sides)
          + "   (miles: over the whole rollout; TRL: inside generate)")
    print(f"{'peak RSS, process tree (GB)':34}" + "".join(f"{s.peak_rss / 1e9:{width}.2f}" for s in sides))
    print(f"{'start to first RL step (s)':34}" + "".join(f"{s.first_step_s:{width}.1f}" for s in sides))
    print(f"{'wall time, whole run (s)':34}" + "".join(f"{s.wall_s:{width}.1f}" for s in sides))
    print("held-out greedy accuracy (wall s since launch, step, accuracy):")
    for s in sides:
        print(f"  {s.name:14} " + "  ".join(f"{tt:.0f}s/{st}:{acc:.3f}" for tt, st, acc in s.evals))
    m, trls = sides[0], sides[1:]
    rows: list[dict] = []
    for k, t in enumerate(trls):
        vs = "" if k == 0 else f" ({t.name})"
        tm, tt = m.time_to(a.target_acc), t.time_to(a.target_acc)
        print(f"time to held-out {a.target_acc}: miles {'not reached' if tm is None else f'{tm:.0f} s'}, "
              f"{t.name} {'not reached' if tt is None else f'{tt:.0f} s'}")
        steps_ratio = med[t.name] / med["miles"]
        wall_ratio = (tm / tt) if tm is not None and tt is not None else None
        goal = k == 0  # the goals are against TRL at its default threads
        rows += [
            {"what": f"RL loop steps/s vs TRL GRPOTrainer{vs}", "value": steps_ratio, "unit": "x TRL", "goal": ">= 2" if goal else "",
             "met": steps_ratio >= 2 if goal else None},
            {"what": f"RL loop wall time to held-out {a.target_acc} vs TRL{vs}", "value": wall_ratio, "unit": "x TRL",
             "goal": "<= 0.5" if goal else "", "met": None if wall_ratio is None or not goal else wall_ratio <= 0.5},
            {"what": f"start to first RL step vs TRL{vs}", "value": m.first_step_s / t.first_step_s, "unit": "x TRL",
             "goal": "<= 1" if goal else "", "met": m.first_step_s <= t.first_step_s if goal else None},
            {"what": f"rollout tokens/s vs TRL's generate{vs} (miles: whole rollout)", "value": gen["miles"] / gen[t.name], "unit": "x TRL", "goal": "", "met": None},
            {"what": f"peak RSS vs TRL{vs}", "value": m.peak_rss / t.peak_rss, "unit": "x TRL", "goal": "<= 2" if goal else "",
             "met": m.peak_rss <= 2 * t.peak_rss if goal else None},
        ]
    if engine_rates is not None:
        ours, theirs = engine_rates
        print(f"generation alone, the rollout's batch in one process: built-in engine {ours:.0f} tokens/s, "
              f"Hugging Face generate {theirs:.0f} tokens/s")
        rows.append({"what": "built-in engine vs HF generate, the rollout's batch, generation alone", "value": ours / theirs,
                     "unit": "x generate", "goal": ">= 1", "met": ours >= theirs})
    print("\nratios (miles / TRL):")
    for r in rows:
        v = "n/a (target not reached by both)" if r["value"] is None else f"{r['value']:.2f}x"
        print(f"  {r['what']:62} {v:>14}   goal {r['goal'] or '-'}")
    return rows


def meets(value: float | None, goal: str) -> bool | None:
    """Whether `value` meets a goal written as ">= 2" or "<= 0.5" (None: no goal, or no value)."""
    if value is None or not goal:
        return None
    op, bound = goal.split()
    return value >= float(bound) if op == ">=" else value <= float(bound)


def over_seeds(rows: list[dict], seeds: list[int]) -> list[dict]:
    """One row per ratio: the median over the seeds (each seed's own row stays in the output too)."""
    out: list[dict] = []
    for what in dict.fromkeys(r["what"].rsplit(" [seed ", 1)[0] for r in rows):
        mine = [r for r in rows if r["what"].rsplit(" [seed ", 1)[0] == what]
        values = [r["value"] for r in mine if r["value"] is not None]
        value = statistics.median(values) if len(values) == len(mine) else None  # a seed that missed the target: no median
        out.append({"what": f"{what} (median of seeds {', '.join(map(str, seeds))})", "value": value,
                    "unit": mine[0]["unit"], "goal": mine[0]["goal"], "met": meets(value, mine[0]["goal"])})
    return out


def learning_rows(finals: dict[str, list[float | None]], a: argparse.Namespace) -> list[dict]:
    """Per-step learning side by side: each TRL side's mean held-out accuracy after the last step over
    the seeds against miles' (a ratio near 1 is equal learning per step; the spread is in the name)."""
    def stats(accs: list[float | None]) -> tuple[float, str] | None:
        known = [x for x in accs if x is not None]
        return (statistics.mean(known), f"{statistics.mean(known):.3f} ({min(known):.3f}-{max(known):.3f})") if known else None

    ours = stats(finals.get("miles", []))
    rows = []
    for name, accs in finals.items():
        theirs = stats(accs)
        if name == "miles" or ours is None or theirs is None:
            continue
        rows.append({"what": f"held-out after step {a.steps}, mean (range) of {len(accs)} seeds: miles {ours[1]} vs {name} {theirs[1]}",
                     "value": ours[0] / theirs[0] if theirs[0] else None, "unit": "x TRL", "goal": "", "met": None})
    return rows


def final_accuracy(side: Side) -> float | None:
    return side.evals[-1][2] if side.evals else None


def missing_bench_extra() -> str | None:
    """The packages TRL's side needs that are not installed, as one sentence with the command that installs them."""
    import importlib.util

    missing = [name for name in ("trl", "datasets") if importlib.util.find_spec(name) is None]
    if not missing:
        return None
    return (f"bench/vs_trl.py needs {' and '.join(missing)} (the bench-only extra, never a runtime dependency); "
            "install it with: pip install -e \".[bench]\"")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=150, help="GRPO steps (rollouts) per side")
    ap.add_argument("--eval-interval", type=int, default=25, help="held-out greedy eval every this many steps (and at step 0)")
    ap.add_argument("--target-acc", type=float, default=0.4, help="held-out accuracy for the time-to-accuracy ratio")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0],
                    help="run the whole comparison once per seed (prepare seed: model, split, warm start; and rollout seed)")
    ap.add_argument("--trl-threads", default="default,1",
                    help="TRL's torch thread settings, comma-separated: 'default' (torch's own count) and/or numbers; the first is what the goals compare with")
    ap.add_argument("--timeout-s", type=float, default=3600.0, help="kill a side after this long")
    ap.add_argument("--keep", type=Path, default=None, help="work here instead of a deleted temporary folder")
    ap.add_argument("--tiny", action="store_true", help="3 steps, eval every 2, the debug recipe's 2 SFT steps (the smoke test)")
    ap.add_argument("--json", type=Path, default=None, help="also write the ratios here (bench/run_all.py reads it)")
    ap.add_argument("--side-by-side", action="store_true",
                    help="run the two sides at the same time (they share the cores; for a machine whose load moves)")
    a = ap.parse_args()
    a.sft_steps = 2 if a.tiny else 375  # the recipe's warm start (its debug_minimal value for --tiny)
    if a.tiny:
        a.steps, a.eval_interval = 3, 2
    threads = [t.strip() for t in a.trl_threads.split(",") if t.strip()]
    if not threads or any(t != "default" and not (t.isdigit() and int(t) > 0) for t in threads):
        print(f"--trl-threads {a.trl_threads!r}: give 'default' and/or positive numbers, comma-separated (e.g. default,1).", file=sys.stderr)
        return 2
    problem = missing_bench_extra()
    if problem:
        print(problem, file=sys.stderr)
        return 2
    all_rows: list[dict] = []
    finals: dict[str, list[float | None]] = {}
    for seed in a.seeds:
        a.seed = seed
        with tempfile.TemporaryDirectory(prefix="miles-vs-trl-") as tmp:
            work = (a.keep / f"seed{seed}" if len(a.seeds) > 1 else a.keep) if a.keep else Path(tmp)
            work.mkdir(parents=True, exist_ok=True)
            engine = prepared_inputs(work, seed, a.sft_steps)
            if a.side_by_side:  # all at once: on a machine whose load moves, every side sees the same load
                import concurrent.futures

                with concurrent.futures.ThreadPoolExecutor(1 + len(threads)) as pool:
                    futures = [pool.submit(run_miles, work, a)] + [pool.submit(run_trl, work, engine, a, t) for t in threads]
                    sides = [f.result() for f in futures]
            else:
                sides = [run_miles(work, a)] + [run_trl(work, engine, a, t) for t in threads]
            # After both sides, alone on the machine (never while a side runs: it would take their cores).
            engine_rates = engine_vs_generate(engine, repeats=3 if a.tiny else 20, seed=seed)
        if len(a.seeds) > 1:
            print(f"\n--- seed {seed}")
        rows = summary(sides, a, engine_rates)
        for s in sides:
            finals.setdefault(s.name, []).append(final_accuracy(s))
        all_rows += [{**r, "what": f"{r['what']} [seed {seed}]", "seed": seed} for r in rows] if len(a.seeds) > 1 else rows
    if len(a.seeds) > 1:
        print("\nheld-out greedy accuracy after the last step, per seed (learning per step, side by side):")
        for name, accs in finals.items():
            known = [x for x in accs if x is not None]
            mean = f"mean {statistics.mean(known):.3f}, spread {min(known):.3f}-{max(known):.3f}" if known else "n/a"
            print(f"  {name:14} " + " / ".join("n/a" if x is None else f"{x:.3f}" for x in accs) + f"   ({mean})")
        all_rows = over_seeds(all_rows, a.seeds) + learning_rows(finals, a) + all_rows
    if a.json:
        a.json.write_text(json.dumps({"bench": "vs_trl", "rows": all_rows, "final_accuracy": finals}, indent=2))
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--trl-child":
        trl_child(json.loads(sys.argv[2]))
    else:
        raise SystemExit(main())
