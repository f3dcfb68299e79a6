"""The table of bad invocations, each through the real `miles` program in a subprocess.

Every row is one command a user could type: the exit code it must end with (2: a user error), a
fragment of the one sentence it must print, and (for runs that are not `--dry-run`) that nothing was
left behind in the output directory. Configuration errors use `--dry-run`, which must catch every
error the run would raise before it starts; input errors also run for real, since they must stop the
run before Ray starts. The subprocesses run in parallel (they are independent) and each row is its
own test. Fixtures: a stand-in model directory (config.json only: nothing here loads a model), good
and broken data files, broken checkpoint directories, a locked and a foreign run directory.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

MILES = [sys.executable, "-m", "miles_cli.main"]
ENV = {**os.environ, "COLUMNS": "4000", "NO_COLOR": "1", "TERMINAL_WIDTH": "4000"}


def _files(root: Path) -> dict[str, str]:
    hf = root / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    (root / "not_hf").mkdir()
    rows = [{"input": f"{a}+{b}=", "label": str(a + b)} for a in range(4) for b in range(4)]
    (root / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:4]))
    (root / "garbled.jsonl").write_text('{"input": "1+1=", "label": "2"}\n{"input": "2+2=", "lab\n')
    (root / "wrong_key.jsonl").write_text('{"question": "1+1=", "label": "2"}\n')
    (root / "empty.jsonl").write_text("\n")
    (root / "data.txt").write_text('{"input": "1+1="}\n')
    (root / "latin1.jsonl").write_bytes('{"input": "caf\xe9"}\n'.encode("latin-1"))
    garbage = root / "ckpt_garbage"
    garbage.mkdir()
    (garbage / "latest_checkpointed_iteration.txt").write_text("garbage\n")
    dangling = root / "ckpt_dangling"
    dangling.mkdir()
    (dangling / "latest_checkpointed_iteration.txt").write_text("7\n")
    (root / "a_file").write_text("x")
    (root / "gen_hooks.py").write_text("def sync_generate(input):\n    return input.sample\n\n\nasync def rollout(input):\n    return []\n\n\nclass Rollout:\n    async def __call__(self, input):\n        return []\n")
    (root / "neither").mkdir()
    # A finished run's checkpoints (only what the checks read: the tracker and the files it names).
    finished = root / "out" / "finished" / "checkpoints"
    (finished / "iter_0000499").mkdir(parents=True)
    for name in ("trainer_state.pt", "extra.json"):
        (finished / "iter_0000499" / name).write_text("{}")
    (finished / "latest_checkpointed_iteration.txt").write_text("499\n")
    # A run directory that records a debug_minimal run of tiny-qwen3.
    foreign = root / "out" / "debugrun"
    foreign.mkdir(parents=True)
    ident = {"recipe": {"model_name": "tiny-qwen3", "mode": "debug_minimal", "prepare_seed": 0, "sft_steps": 2, "train_backend": "torch"}}
    (foreign / "run.json").write_text(json.dumps({"run_id": "debugrun", "identity": ident}))
    return {"root": str(root), "hf": str(hf), "out": str(root / "out")}


def _base(f: dict[str, str], command: str) -> list[str]:
    """Engine flags every row starts from: valid inputs, so each row's own flags are the only mistake."""
    r = f["root"]
    data = [] if command == "eval" else ["--prompt-data", f"{r}/train.jsonl"]
    return ["--hf-checkpoint", f["hf"], *data, "--eval-prompt-data", "arith", f"{r}/eval.jsonl"]


# (id, command, recipe/run options, engine flags after `--`, exit code, message fragment)
# "{root}" and "{pid}" are filled in; every row also gets --output-dir {root}/out.
ROWS = [
    # --- options that do not parse
    ("typo", "train", ["--rollout-batch-sise", "3", "--dry-run"], [], 2, "--rollout-batch-sise"),
    ("not-a-number", "train", ["--rollout-batch-size", "many", "--dry-run"], [], 2, "--rollout-batch-size"),
    ("bad-choice", "train", ["--advantage-estimator", "dpo", "--dry-run"], [], 2, "--advantage-estimator"),
    ("bad-mode", "train", ["--mode", "fast", "--dry-run"], [], 2, "--mode"),
    ("unknown-recipe", "train", ["--model-name", "gpt-17", "--dry-run"], [], 2, "is not a recipe"),
    ("extra-args-typo", "train", ["--extra-args", "--lr-typo 1", "--dry-run"], [], 2, "--lr-typo"),
    ("stray-argument", "train", ["stray", "--dry-run"], [], 2, "stray"),
    ("eval-takes-no-train-flag", "eval", ["--dry-run"], ["--lr", "1e-3"], 2, "--lr"),
    # --- configuration errors (resolve)
    ("gbs-not-divisor", "train", ["--dry-run"], ["--global-batch-size", "7"], 2, "--global-batch-size"),
    ("num-epoch-0", "train", ["--dry-run"], ["--num-epoch", "0"], 2, "--num-epoch"),
    ("num-rollout-0", "train", ["--dry-run"], ["--num-rollout", "0"], 2, "--num-rollout"),
    ("critic-option-without-ppo", "train", ["--critic-lr", "1e-5", "--dry-run"], [], 2, "add --advantage-estimator ppo or drop --critic-lr"),
    ("value-clip-without-ppo", "train", ["--value-clip", "0.1", "--dry-run"], [], 2, "add --advantage-estimator ppo or drop --value-clip"),
    ("ppo-with-reward-kl", "train", ["--advantage-estimator", "ppo", "--kl-coef", "0.1", "--dry-run"], [], 2, "--use-kl-loss"),
    ("ppo-critic-save", "train", ["--advantage-estimator", "ppo", "--critic-save", "x", "--dry-run"], [], 2, "--critic-save"),
    ("ppo-critic-layout", "train", ["--advantage-estimator", "ppo", "--critic-num-gpus-per-node", "3", "--dry-run"], [], 2,
     "shares the actor's devices"),
    ("megatron-sp-without-tp", "train", ["--train-backend", "megatron", "--sequence-parallel", "--dry-run"], [], 2,
     "--sequence-parallel"),
    ("fault-tolerance-unsupported", "train", ["--use-fault-tolerance", "--dry-run"], [], 2, "--use-fault-tolerance"),
    ("rollout-dtype-with-sglang", "train", ["--rollout-backend", "sglang", "--rollout-dtype", "bfloat16", "--dry-run"], [], 2,
     "--sglang-dtype"),
    ("eps-clip-c", "train", ["--dry-run"], ["--eps-clip-c", "0.5"], 2, "--eps-clip-c"),
    # asynchronous training: upstream's constraints (miles/config/asynchrony.py)
    ("train-async-colocate", "train", ["--dry-run"], ["--train-async", "--colocate"], 2, "--train-async generates while the trainer trains"),
    ("fully-async-colocate", "train", ["--dry-run"], ["--fully-async", "--use-tis", "--colocate"], 2, "--fully-async generates while the trainer trains"),
    ("fully-async-needs-correction", "train", ["--dry-run"], ["--fully-async", "--no-colocate"], 2, "needs an off-policy correction; add --use-tis"),
    ("train-async-needs-correction", "train", ["--dry-run"], ["--train-async", "--no-colocate"], 2, "--train-async trains on samples from older weights"),
    ("fully-async-partial", "train", ["--dry-run"], ["--fully-async", "--use-tis", "--no-colocate", "--partial-rollout"], 2, "drop --partial-rollout"),
    ("two-async-modes", "train", ["--dry-run"], ["--train-async", "--fully-async", "--use-tis", "--no-colocate"], 2, "two driver modes"),
    ("staleness-without-fully-async", "train", ["--dry-run"], ["--max-weight-staleness", "1"], 2, "--max-weight-staleness bounds the buffer of --fully-async"),
    ("staleness-below-interval", "train", ["--dry-run"], ["--fully-async", "--use-tis", "--no-colocate", "--update-weights-interval", "3", "--max-weight-staleness", "1"], 2,
     "give --max-weight-staleness 2 or more"),
    ("interval-without-async", "train", ["--dry-run"], ["--update-weights-interval", "2"], 2, "--update-weights-interval is honoured only by"),
    ("mask-without-partial", "train", ["--dry-run"], ["--mask-offpolicy-in-partial-rollout"], 2, "add --partial-rollout or drop the mask"),
    ("train-async-rollout-only", "train", ["--dry-run"], ["--train-async", "--no-colocate", "--debug-rollout-only"], 2, "--debug-rollout-only never trains"),
    ("save-interval-0", "train", ["--dry-run"], ["--save-interval", "0"], 2, "--save-interval"),
    ("eval-interval-0", "train", ["--dry-run"], ["--eval-interval", "0"], 2, "--eval-interval"),
    ("top-p", "train", ["--dry-run"], ["--rollout-top-p", "1.5"], 2, "--rollout-top-p"),
    ("temperature", "train", ["--dry-run"], ["--rollout-temperature", "-1"], 2, "--rollout-temperature"),
    ("prometheus-port-range", "train", ["--dry-run"], ["--prometheus-port", "70000"], 2, "--prometheus-port"),
    ("save-hf-placeholder", "train", ["--dry-run"], ["--save-hf", "x/{step}"], 2, "--save-hf"),
    ("keep-last-0", "train", ["--dry-run"], ["--keep-last-checkpoints", "0"], 2, "--keep-last-checkpoints"),
    ("rm-type", "train", ["--dry-run"], ["--rm-type", "nope"], 2, "--rm-type"),
    ("rm-url", "train", ["--dry-run"], ["--rm-url", "ftp://x"], 2, "--rm-url"),
    ("micro-batch-0", "train", ["--dry-run"], ["--micro-batch-size", "0"], 2, "--micro-batch-size"),
    ("over-sampling", "train", ["--dry-run"], ["--over-sampling-batch-size", "1"], 2, "--over-sampling-batch-size"),
    ("prompt-longer-than-context", "train", ["--dry-run"], ["--rollout-max-prompt-len", "600", "--rollout-max-context-len", "100"], 2, "--rollout-max-prompt-len"),
    ("negative-lr", "train", ["--dry-run"], ["--lr", "-1"], 2, "--lr"),
    ("lora-without-targets", "train", ["--dry-run"], ["--lora-rank", "8"], 2, "--lora-rank needs --target-modules"),
    ("lora-alpha-without-rank", "train", ["--dry-run"], ["--lora-alpha", "32"], 2, "--lora-alpha applies only to LoRA runs"),
    ("lora-with-megatron", "train", ["--train-backend", "megatron", "--dry-run"], ["--lora-rank", "8", "--target-modules", "all-linear"], 2,
     "megatron-core 0.16.1 has no LoRA"),
    ("lora-with-fsdp", "train", ["--train-backend", "fsdp", "--dry-run"], ["--lora-rank", "8", "--target-modules", "all-linear"], 2,
     "--train-backend fsdp is not supported yet"),
    ("lora-sync-from-tensor", "train", ["--dry-run"], ["--lora-rank", "8", "--target-modules", "all-linear", "--lora-sync-from-tensor"], 2,
     "--lora-sync-from-tensor true cannot take effect"),
    ("lora-excludes-everything", "train", ["--dry-run"], ["--lora-rank", "8", "--target-modules", "q_proj", "--exclude-modules", "q_proj"], 2,
     "--exclude-modules removes every module"),
    ("lora-with-other-ref", "train", ["--dry-run"], ["--lora-rank", "8", "--target-modules", "all-linear", "--use-kl-loss", "--ref-load", "{root}/not_hf"], 2,
     "the reference is the base model with its adapters disabled"),
    ("global-batch-over-workers", "train", ["--num-gpus-per-node", "3", "--dry-run"], ["--global-batch-size", "32"], 2, "must be divisible by the number of training workers"),
    # --- inputs: models, data, checkpoints, hooks, ports (--dry-run)
    ("hf-missing", "train", ["--dry-run"], ["--hf-checkpoint", "{root}/nope"], 2, "--hf-checkpoint {root}/nope does not exist"),
    ("hf-without-config", "train", ["--dry-run"], ["--hf-checkpoint", "{root}/not_hf"], 2, "no config.json"),
    ("prompt-data-missing", "train", ["--dry-run"], ["--prompt-data", "{root}/nope.jsonl"], 2, "--prompt-data {root}/nope.jsonl does not exist"),
    ("prompt-data-garbled", "train", ["--dry-run"], ["--prompt-data", "{root}/garbled.jsonl"], 2, "garbled.jsonl:2: not valid JSON"),
    ("prompt-data-wrong-key", "train", ["--dry-run"], ["--prompt-data", "{root}/wrong_key.jsonl"], 2, "set --input-key"),
    ("label-key-missing", "train", ["--dry-run"], ["--label-key", "answer"], 2, "set --label-key"),
    ("prompt-data-empty", "train", ["--dry-run"], ["--prompt-data", "{root}/empty.jsonl"], 2, "no rows"),
    ("prompt-data-suffix", "train", ["--dry-run"], ["--prompt-data", "{root}/data.txt"], 2, "unsupported file type"),
    ("prompt-data-not-utf8", "train", ["--dry-run"], ["--prompt-data", "{root}/latin1.jsonl"], 2, "not UTF-8"),
    ("eval-data-missing", "train", ["--dry-run"], ["--eval-prompt-data", "arith", "{root}/nope.jsonl"], 2, "--eval-prompt-data arith {root}/nope.jsonl"),
    ("eval-data-garbled", "train", ["--dry-run"], ["--eval-prompt-data", "arith", "{root}/garbled.jsonl"], 2, "not valid JSON"),
    ("ref-load-missing", "train", ["--dry-run"], ["--use-kl-loss", "--ref-load", "{root}/nope"], 2, "--ref-load {root}/nope does not exist"),
    ("load-garbage-tracker", "train", ["--dry-run"], ["--load", "{root}/ckpt_garbage"], 2, "holds 'garbage', not a rollout id"),
    ("load-dangling-tracker", "train", ["--dry-run"], ["--load", "{root}/ckpt_dangling"], 2, "names rollout 7 but iter_0000007 is missing"),
    ("load-is-a-file", "train", ["--dry-run"], ["--load", "{root}/a_file"], 2, "is a file"),
    ("eval-checkpoint-garbage", "eval", ["--checkpoint", "{root}/ckpt_garbage", "--dry-run"], [], 2, "--checkpoint {root}/ckpt_garbage: latest_checkpointed_iteration.txt holds 'garbage'"),
    ("eval-checkpoint-missing", "eval", ["--checkpoint", "{root}/nope", "--dry-run"], [], 2, "--checkpoint {root}/nope does not exist"),
    ("eval-checkpoint-neither", "eval", ["--checkpoint", "{root}/neither", "--dry-run"], [], 2, "is neither a Hugging Face model directory"),
    ("hook-module-missing", "train", ["--dry-run"], ["--dynamic-sampling-filter-path", "no_such_module.fn"], 2, "--dynamic-sampling-filter-path"),
    ("hook-file-missing", "train", ["--dry-run"], ["--custom-rm-path", "{root}/nope.py:fn"], 2, "--custom-rm-path"),
    ("generate-fn-not-async", "train", ["--dry-run"], ["--custom-generate-function-path", "{root}/gen_hooks.py:sync_generate"], 2, "--custom-generate-function-path {root}/gen_hooks.py:sync_generate is not an async function"),
    ("generate-fn-missing-module", "train", ["--dry-run"], ["--custom-generate-function-path", "no_such_module.generate"], 2, "--custom-generate-function-path 'no_such_module.generate': module"),
    ("rollout-fn-a-class", "train", ["--dry-run"], ["--rollout-function-path", "{root}/gen_hooks.py:Rollout"], 2, "--rollout-function-path {root}/gen_hooks.py:Rollout is a class"),
    ("rollout-fn-missing-attr", "train", ["--dry-run"], ["--rollout-function-path", "{root}/gen_hooks.py:nope"], 2, "has no attribute 'nope'"),
    ("rollout-fn-with-filter", "train", ["--dry-run"], ["--rollout-function-path", "{root}/gen_hooks.py:rollout", "--dynamic-sampling-filter-path", "miles.rollout.filters.check_reward_nonzero_std"], 2, "--dynamic-sampling-filter-path is not applied with --rollout-function-path"),
    ("rollout-fn-with-over-sampling", "train", ["--dry-run"], ["--rollout-function-path", "{root}/gen_hooks.py:rollout", "--over-sampling-batch-size", "64"], 2, "--over-sampling-batch-size is not used with --rollout-function-path"),
    ("eval-generate-fn-not-async", "eval", ["--dry-run"], ["--custom-generate-function-path", "{root}/gen_hooks.py:sync_generate"], 2, "is not an async function"),
    ("tool-executor-not-async", "train", ["--dry-run"], ["--custom-generate-function-path", "miles.rollout.generate_hub.multi_turn.generate", "--generate-execute-tool-function-path", "{root}/gen_hooks.py:sync_generate"], 2, "--generate-execute-tool-function-path {root}/gen_hooks.py:sync_generate is not an async function"),
    ("tool-specs-not-a-list", "train", ["--dry-run"], ["--custom-generate-function-path", "miles.rollout.generate_hub.multi_turn.generate", "--generate-tool-specs-path", "{root}/gen_hooks.py:rollout"], 2, "--generate-tool-specs-path {root}/gen_hooks.py:rollout must be a list of OpenAI tool dicts"),
    ("tool-specs-file-missing", "train", ["--dry-run"], ["--custom-generate-function-path", "miles.rollout.generate_hub.multi_turn.generate", "--generate-tool-specs-path", "{root}/nope.json"], 2, "--generate-tool-specs-path {root}/nope.json: no such file"),
    ("tool-options-with-single-turn", "train", ["--dry-run"], ["--generate-execute-tool-function-path", "miles.rollout.tools.builtin.execute_tool"], 2, "--generate-execute-tool-function-path is not used by the default single-turn generate function"),
    ("max-turns-zero", "train", ["--dry-run"], ["--custom-generate-function-path", "miles.rollout.generate_hub.multi_turn.generate", "--generate-max-turns", "0"], 2, "--generate-max-turns 0 must be at least 1"),
    ("tool-parser-unknown", "train", ["--dry-run"], ["--generate-tool-call-parser", "hermes"], 2, "--generate-tool-call-parser"),
    ("agentic-without-agent", "train", ["--dry-run"], ["--custom-generate-function-path", "miles.rollout.generate_hub.agentic_tool_call.generate", "--use-session-server"], 2, "needs --custom-agent-function-path"),
    ("agentic-without-session-server", "train", ["--dry-run"], ["--custom-generate-function-path", "miles.rollout.generate_hub.agentic_tool_call.generate", "--custom-agent-function-path", "{root}/gen_hooks.py:rollout"], 2, "needs --use-session-server"),
    ("agent-not-async", "train", ["--dry-run"], ["--custom-generate-function-path", "miles.rollout.generate_hub.agentic_tool_call.generate", "--use-session-server", "--custom-agent-function-path", "{root}/gen_hooks.py:sync_generate"], 2, "--custom-agent-function-path {root}/gen_hooks.py:sync_generate is not an async function"),
    ("prometheus-port-busy", "train", ["--dry-run"], ["--use-prometheus", "--prometheus-port", "{busy_port}"], 2, "--prometheus-port {busy_port} is already in use"),
    ("prometheus-host-foreign", "train", ["--dry-run"], ["--use-prometheus", "--prometheus-host", "203.0.113.1"], 2, "--prometheus-host 203.0.113.1"),
    # --- run directories: a live run's, another run's, another run's checkpoints
    ("run-dir-locked", "train", ["--run-id", "locked", "--dry-run"], [], 2, "in use by a live run (pid {pid}"),
    ("run-dir-of-another-run", "train", ["--run-id", "debugrun", "--dry-run"], [], 2, "--mode debug_minimal then, normal now"),
    ("save-holds-another-runs-checkpoints", "train", ["--run-id", "finished", "--dry-run"], ["--load", "{root}/ckpt_garbage_free"], 2, "already holds the checkpoints of a run (up to rollout 499)"),
    # --- the same input errors without --dry-run: stopped before Ray starts, nothing left behind
    ("real-ref-load-missing", "train", ["--run-id", "fresh1"], ["--use-kl-loss", "--ref-load", "{root}/nope"], 2, "--ref-load"),
    ("real-garbled-jsonl", "train", ["--run-id", "fresh2"], ["--prompt-data", "{root}/garbled.jsonl"], 2, "not valid JSON"),
    ("real-garbage-load", "train", ["--run-id", "fresh3"], ["--load", "{root}/ckpt_garbage"], 2, "not a rollout id"),
    ("real-eval-garbage-checkpoint", "eval", ["--run-id", "fresh4", "--checkpoint", "{root}/ckpt_garbage"], [], 2, "not a rollout id"),
    ("real-locked", "train", ["--run-id", "locked"], [], 2, "--run-id"),
    ("real-overwrite-finished", "train", ["--run-id", "finished"], ["--load", "{root}/ckpt_garbage_free"], 2, "--run-id"),
]


def _fill(text: str, values: dict[str, str]) -> str:
    for key, value in values.items():
        text = text.replace("{" + key + "}", value)
    return text


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    from miles.run_lock import RunLock

    root = tmp_path_factory.mktemp("bad")
    f = _files(root)
    with socket.socket() as busy, RunLock([root / "out" / "locked"]):
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        values = {"root": str(root), "pid": str(os.getpid()), "busy_port": str(busy.getsockname()[1])}
        before = sorted(str(p) for p in (root / "out").rglob("*"))

        def one(row):
            _, command, options, engine, _, _ = row
            argv = [command, *[_fill(a, values) for a in options], "--output-dir", f["out"], "--", *_base(f, command), *[_fill(a, values) for a in engine]]
            return subprocess.run(MILES + argv, cwd=root, env=ENV, capture_output=True, text=True, timeout=300)

        with ThreadPoolExecutor(max_workers=6) as pool:
            done = dict(zip((row[0] for row in ROWS), pool.map(one, ROWS)))
        after = sorted(str(p) for p in (root / "out").rglob("*"))
    return done, values, before, after, root


def test_the_table_has_at_least_40_rows():
    assert len(ROWS) >= 40 and len({row[0] for row in ROWS}) == len(ROWS)


@pytest.mark.parametrize("row", ROWS, ids=[row[0] for row in ROWS])
def test_bad_invocation(row, results):
    done, values, _, _, _ = results
    name, _, _, _, code, fragment = row
    r = done[name]
    assert r.returncode == code, f"exit {r.returncode}\n{r.stdout[-1500:]}\n{r.stderr[-2500:]}"
    err = " ".join(r.stderr.split())  # rich may wrap the sentence
    assert " ".join(_fill(fragment, values).split()) in err, r.stderr[-2500:]
    assert "Traceback" not in r.stderr and "Traceback" not in r.stdout
    assert len([line for line in r.stderr.splitlines() if line.startswith("Error:")]) <= 1


def test_nothing_is_left_behind(results):
    """No row, dry run or real, created a file or directory under the output directory."""
    _, _, before, after, root = results
    assert after == before, sorted(set(after) - set(before))
