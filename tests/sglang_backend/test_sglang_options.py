"""The `--sglang-*` / `--sglang-router-*` options: generated from the snapshot, shown, parsed, passed on.

- every CLI field of the pinned ServerArgs/RouterArgs that miles does not set itself is an option,
  with SGLang's default, and `miles train --rollout-backend sglang --help-group sglang` shows that default;
- the options SGLang removed exit 2 with the flag to use instead, from the command line, after `--`
  and in --extra-args; upstream's `--router-*` spelling points at `--sglang-router-*`;
- an SGLang option without `--rollout-backend sglang` is a user error;
- `--dry-run` prints the servers' and the router's argv with exactly the options that were changed.

Run: `pytest tests/sglang/test_sglang_options.py` (~1 min; no SGLang needed).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from miles.config import sglang as sg
from miles.config.engine import option_specs
from miles.config.values import format_value
from miles.rollout.sglang.snapshot import router_fields, server_fields
from tests.cli.helpers import help_rows, invoke, shown_default

MILES = [sys.executable, "-m", "miles_cli.main"]


def test_every_server_field_is_an_option_except_those_miles_sets():
    names = {s.name for s in option_specs() if s.group == "sglang"}
    fields = {e["name"] for e in server_fields()}
    assert names == {sg.SERVER_PREFIX + n for n in fields - set(sg.SERVER_SET_BY_MILES) - {"model_path"}}
    assert len(names) > 500
    for needed in ("ep_size", "moe_a2a_backend", "moe_runner_backend", "deepep_mode", "mem_fraction_static", "chunked_prefill_size"):
        assert sg.SERVER_PREFIX + needed in names, needed
    for gone in ("enable_ep_moe", "enable_deepep_moe", "enable_overlap_schedule", "cuda_graph_max_bs", "tp_size", "port"):
        assert sg.SERVER_PREFIX + gone not in names, gone


def test_every_router_option_is_an_option_except_those_miles_sets():
    names = {s.name for s in option_specs() if s.group == "sglang_router"}
    fields = {e["name"] for e in router_fields()}
    assert names == {sg.ROUTER_PREFIX + n for n in fields - set(sg.ROUTER_SET_BY_MILES)}
    assert {"sglang_router_request_timeout_secs", "sglang_router_health_check_interval_secs"} <= names
    # --sglang-router-policy is one option (the rollout group's), driving the built-in servers' router too
    assert [s.group for s in option_specs() if s.name == "sglang_router_policy"] == ["rollout"]


def test_defaults_are_sglangs_own():
    by = {s.name: s for s in option_specs()}
    assert by["sglang_mem_fraction_static"].default is None  # SGLang derives it from the GPU
    assert by["sglang_ep_size"].default == 1
    assert by["sglang_deepep_mode"].default == "auto" and set(by["sglang_deepep_mode"].choices) == {"auto", "normal", "low_latency"}
    assert by["sglang_moe_a2a_backend"].default == "none" and "deepep" in by["sglang_moe_a2a_backend"].choices
    assert by["sglang_router_policy"].default == "round_robin"  # miles' default; its help says why
    assert by["sglang_router_request_timeout_secs"].default == 1800
    # miles' own router defaults (a second router on the host must not collide on 0.0.0.0:29000)
    assert by["sglang_router_prometheus_host"].default == "127.0.0.1"
    assert by["sglang_router_prometheus_port"].default is None


def test_help_lists_them_only_under_the_sglang_backend_with_their_defaults():
    plain = help_rows(invoke(["train", "--help"]).output)
    assert not any(flag.startswith("--sglang-") for flag in plain if flag != "--sglang-server-concurrency")
    # the SGLang panels wait behind --help-group sglang (a recipe's --help stays a screenful)
    assert "--help-group sglang" in invoke(["train", "--rollout-backend", "sglang", "--help"]).output
    rows = help_rows(invoke(["train", "--rollout-backend", "sglang", "--help-group", "sglang"]).output)
    checked = 0
    for s in option_specs():
        if s.group not in sg.GROUPS:
            continue
        assert s.flag in rows, s.flag
        assert shown_default(rows[s.flag]) == format_value(s.default), (s.flag, rows[s.flag])
        checked += 1
    assert checked > 600


@pytest.mark.parametrize(
    "flag, hint",
    [
        ("--sglang-enable-ep-moe", "--sglang-ep-size"),
        ("--sglang-enable-deepep-moe", "--sglang-moe-a2a-backend deepep"),
        ("--sglang-enable-overlap-schedule", "--sglang-disable-overlap-schedule"),
        ("--sglang-cuda-graph-max-bs", "--sglang-cuda-graph-max-bs-decode"),
        ("--router-policy", "--sglang-router-policy"),
    ],
)
@pytest.mark.parametrize("where", ["command line", "after --", "--extra-args"])
def test_removed_flags_exit_2_with_did_you_mean(flag, hint, where, tmp_path):
    args = ["train", "--rollout-backend", "sglang", "--dry-run"]
    if where == "command line":
        args += [flag, "8"]
    elif where == "after --":
        args += ["--", flag, "8"]
    else:
        args += ["--extra-args", f"{flag} 8"]
    r = subprocess.run(MILES + args, capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "did you mean" in r.stderr and hint in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


def test_sglang_option_without_the_sglang_backend_is_a_user_error(tmp_path):
    r = subprocess.run(MILES + ["train", "--sglang-ep-size", "2", "--dry-run"], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1] == (
        "Error: --sglang-ep-size configures SGLang servers, which run only with --rollout-backend sglang; "
        "add --rollout-backend sglang or drop the flag."
    )


def test_dry_run_prints_each_server_and_the_router_with_the_changed_options(tmp_path):
    args = [
        "train", "--model-name", "qwen3-0.6b", "--rollout-backend", "sglang", "--no-colocate",
        "--num-gpus-per-node", "4", "--rollout-num-gpus", "4", "--rollout-num-gpus-per-engine", "2",
        "--sglang-mem-fraction-static", "0.7", "--sglang-ep-size", "2", "--sglang-moe-a2a-backend", "deepep",
        "--sglang-deepep-mode", "low_latency", "--sglang-moe-runner-backend", "deep_gemm", "--sglang-enable-metrics",
        "--sglang-router-policy", "round_robin", "--dry-run",
    ]
    # `train --dry-run` checks the run's inputs as the run would: give it the recipe's model and data.
    (tmp_path / "runs/models/Qwen3-0.6B").mkdir(parents=True)
    (tmp_path / "runs/models/Qwen3-0.6B/config.json").write_text("{}")
    for name in ("dapo-math-17k.jsonl", "aime-2024.jsonl"):
        (tmp_path / "runs/data" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "runs/data" / name).write_text('{"prompt": "1+1=", "label": "2"}\n')
    r = subprocess.run(MILES + args, capture_output=True, text=True, cwd=tmp_path, timeout=120, env={**os.environ, "COLUMNS": "400"})
    assert r.returncode == 0, r.stderr
    lines = [line.strip() for line in r.stdout.splitlines()]
    engines = [line for line in lines if line.startswith("SGLang engine")]
    assert len(engines) == 2
    tail = (
        " --tp-size 2 --random-seed {seed} --nccl-port {nccl} --skip-server-warmup --mem-fraction-static 0.7"
        " --enable-metrics --ep-size 2 --moe-a2a-backend deepep --moe-runner-backend deep_gemm --deepep-mode low_latency"
    )  # miles' own flags, then the changed options in SGLang's field order
    assert engines[0].endswith(tail.format(seed=42, nccl=30001)), engines[0]
    assert engines[1].endswith(tail.format(seed=43, nccl=30003)), engines[1]
    assert "-m sglang.launch_server --model-path runs/models/Qwen3-0.6B --host '<node ip>' --port 30000" in engines[0]
    (router,) = [line for line in lines if line.startswith("sglang-router:")]
    assert router.endswith(
        "-m sglang_router.launch_router --host '<driver ip>' --port 31000 --prometheus-host 127.0.0.1 --prometheus-port 31001 --policy round_robin"
        " --health-check-endpoint /health --request-timeout-secs 14400 --log-level warn --health-check-interval-secs 30"
    )


def test_without_dry_run_and_without_gpus_exits_2_with_one_sentence(tmp_path):
    r = subprocess.run(
        MILES + ["train", "--model-name", "qwen3-0.6b", "--rollout-backend", "sglang"], capture_output=True, text=True, cwd=tmp_path, timeout=120
    )
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("Error: --rollout-backend sglang needs 8 GPUs here (")
    assert "Traceback" not in r.stderr
