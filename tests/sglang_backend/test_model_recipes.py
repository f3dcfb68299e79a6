"""The real-model recipes (recipes/catalog): frozen dry-run plans, deterministic DeepSeek-V4, Hub downloads.

- `miles full-train --model-name X --dry-run` for each catalog recipe prints exactly the checked-in
  plan in tests/sglang_backend/plans/X.txt (resolved options, placement, SGLang processes, env vars,
  prepare steps). After an intended change: `MILES_UPDATE_PLANS=1 pytest tests/sglang_backend/test_model_recipes.py`
  and review the diff.
- each recipe's plan shows `--train-backend megatron` with upstream's layout as resolved values, a
  memory plan that fits its hardware, and what the trainers cannot run yet; `train` exits 2 with
  "cannot train yet"; `--train-backend torch` on qwen3-30b-a3b exits 2 with the memory arithmetic.
- DeepSeek-V4-Flash turns --train-deterministic on by default, with its environment variables.
- every environment variable a recipe sets is in docs/reference/env-vars.md.
- the Hub prepare step: offline it is a user error naming the exact `hf download` command and the
  directory; a present sentinel skips it.

Run: `pytest tests/sglang_backend/test_model_recipes.py` (about a minute; no GPU, no network).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from miles.errors import UserError
from miles.prepare import hub
from recipes import RECIPES
from recipes.catalog import MODULES

ROOT = Path(__file__).resolve().parents[2]
PLANS = Path(__file__).resolve().parent / "plans"
MILES = [sys.executable, "-m", "miles_cli.main"]
NAMES = [m.NAME for m in MODULES]


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MILES_SCRIPT_") and k not in {"RAY_ADDRESS", "PROMETHEUS_PORT"}}
    return {**env, "COLUMNS": "200", "NO_COLOR": "1", "TERM": "dumb", **extra}


def unwrapped(plan: str) -> str:
    """The plan with each wrapped command joined onto one line: where a command wraps depends on the
    length of the interpreter's path (CI's clone is not this checkout), which the snapshot replaces."""
    return re.sub(r" \\\n +", " ", plan)


def dry_run(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(MILES + list(args) + ["--dry-run"], capture_output=True, text=True, cwd=tmp_path, env=clean_env(), timeout=180)


def test_the_five_models_are_registered():
    assert set(NAMES) == {"qwen3-4b", "qwen3-30b-a3b", "deepseek-v4-flash-fp8", "glm-4.7-flash", "kimi-k2"}
    assert all(RECIPES[n] is m for n, m in zip(NAMES, MODULES))


@pytest.mark.parametrize("name", NAMES)
def test_dry_run_plan_is_frozen(name, tmp_path):
    r = dry_run(tmp_path, "full-train", "--model-name", name)
    assert r.returncode == 0, r.stderr
    plan = r.stdout.replace(sys.executable, "<python>")
    snapshot = PLANS / f"{name}.txt"
    if os.environ.get("MILES_UPDATE_PLANS") == "1":
        snapshot.parent.mkdir(exist_ok=True)
        snapshot.write_text(plan)
    assert unwrapped(plan) == unwrapped(snapshot.read_text()), f"the plan of {name} changed; rerun with MILES_UPDATE_PLANS=1 and review the diff"
    for needed in ("Prepare steps", "Placement", "Processes", "sglang.launch_server", "sglang_router.launch_router", "Dry run: nothing was started."):
        assert needed in plan, needed


@pytest.mark.parametrize("name", NAMES)
def test_plan_shows_the_megatron_layout_the_memory_plan_and_what_cannot_train(name, tmp_path):
    spec = RECIPES[name].SPEC
    m = spec.megatron
    r = dry_run(tmp_path, "full-train", "--model-name", name)
    assert r.returncode == 0, r.stdout + r.stderr
    layout = (f"TP{m['tensor_model_parallel_size']} PP{m['pipeline_model_parallel_size']} CP{m['context_parallel_size']} "
              f"EP{m['expert_model_parallel_size']} ETP{m['expert_tensor_parallel_size']}")
    assert f"GPUs for training (--train-backend megatron: {layout})" in r.stdout
    for option, value in m.items():  # every layout value is a resolved option of the run, set by the recipe
        flag = "--" + option.replace("_", "-")
        shown = str(value).lower() if isinstance(value, bool) else str(value)
        assert re.search(rf"│ {re.escape(flag)}\s+│ {re.escape(shown)}\s+│ recipe", r.stdout), (flag, shown)
    assert re.search(rf"Memory plan \(megatron: {layout} DP\d+; {spec.hardware} [\d.]+ GiB per GPU\):", r.stdout)
    assert "\n  fits.\n" in r.stdout
    assert "Cannot train yet" in r.stdout
    assert "on GPUs —" not in r.stdout  # megatron runs on GPUs: models on the device, collectives on device tensors
    if spec.hf_config["architectures"][0] not in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"):
        assert f"miles has no {spec.hf_config['architectures'][0]} family" in r.stdout


@pytest.mark.parametrize("name", ["qwen3-4b", "kimi-k2"])
def test_train_refuses_what_cannot_run_with_exit_2(name, tmp_path):
    r = subprocess.run(MILES + ["train", "--model-name", name], capture_output=True, text=True, cwd=tmp_path, env=clean_env(), timeout=180)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "cannot train yet: " in r.stderr and "Traceback" not in r.stderr
    assert "--transformer-impl transformer_engine" in r.stderr and "(--dry-run shows the whole plan)" in r.stderr
    assert "on GPUs —" not in r.stderr  # the megatron backend itself runs on GPUs
    assert "--bf16" not in r.stderr and "--use-dynamic-batch-size" not in r.stderr  # both run now
    assert not (tmp_path / "runs").exists()  # nothing half-written


def test_qwen3_30b_on_the_torch_backend_does_not_fit_and_says_the_arithmetic(tmp_path):
    r = dry_run(tmp_path, "full-train", "--model-name", "qwen3-30b-a3b", "--train-backend", "torch")
    assert r.returncode == 2, r.stdout + r.stderr
    assert "GPUs for training (--train-backend torch)" in r.stdout  # the megatron layout is not applied to torch
    assert "trainer parameters: 113.7 GiB" in r.stdout  # 30.5B fp32 weights on every GPU
    assert "Error: the memory plan does not fit H100 (torch: DP8): trainer " in r.stderr
    assert "> 79.6 GiB. Options that would fit: --train-backend megatron" in r.stderr


def test_deepseek_v4_trains_deterministically_by_default(tmp_path):
    module = RECIPES["deepseek-v4-flash-fp8"]
    options = module.Options()
    assert options.train_deterministic is True and options.mode == "debug_minimal"
    plan = module.plan(options)
    assert options.engine_values()["deterministic_mode"] is True  # --train-deterministic is the recipe's name of --deterministic-mode
    assert {k: plan.env[k] for k in ("NCCL_ALGO", "NVTE_ALLOW_NONDETERMINISTIC_ALGO", "CUBLAS_WORKSPACE_CONFIG")} == {
        "NCCL_ALGO": "Ring", "NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0", "CUBLAS_WORKSPACE_CONFIG": ":4096:8",
    }  # fmt: skip
    assert plan.env["SGLANG_HEALTH_CHECK_TIMEOUT"] == "120"
    off = module.plan(module.Options(train_deterministic=False))
    assert module.Options(train_deterministic=False).engine_values()["deterministic_mode"] is False and "NCCL_ALGO" not in off.env
    r = dry_run(tmp_path, "full-train", "--model-name", "deepseek-v4-flash-fp8", "--no-train-deterministic")  # train would check the model is there
    assert r.returncode == 0 and "NCCL_ALGO" not in r.stdout
    assert re.search(r"│ --train-deterministic\s+│ false", r.stdout), r.stdout


def test_every_recipe_env_var_is_in_the_env_var_reference():
    reference = (ROOT / "docs/reference/env-vars.md").read_text()
    for name, module in RECIPES.items():
        for var in module.plan(module.Options()).env:
            assert f"`{var}`" in reference, (name, var)


def test_offline_download_names_the_hf_command_and_the_directory(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    local = str(tmp_path / "models/Qwen3-4B")
    with pytest.raises(UserError) as e:
        hub.download("Qwen/Qwen3-4B", local, allow_patterns=["*.json", "*.safetensors"])
    assert str(e.value) == (
        "cannot download Qwen/Qwen3-4B from the Hugging Face Hub (HF_HUB_OFFLINE is set); run "
        f"`hf download Qwen/Qwen3-4B --include '*.json' --include '*.safetensors' --local-dir {local}` on a machine "
        f"with network, put the files in {local}, then create {local}/.miles-download-complete (or rerun miles full-train online)."
    )
    assert not Path(local).exists()


def test_unreachable_hub_is_a_user_error_too(tmp_path, monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens: connection refused
    script = (
        "from miles.prepare import hub\n"
        "from miles.errors import UserError\n"
        "try:\n"
        f"    hub.download('zhuzilin/aime-2024', {str(tmp_path / 'aime')!r}, repo_type='dataset')\n"
        "except UserError as e:\n"
        "    print('USER', e)\n"
    )
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env={**os.environ, "HF_ENDPOINT": "http://127.0.0.1:9"})
    assert r.stdout.startswith("USER cannot download zhuzilin/aime-2024 from the Hugging Face Hub (the Hub is unreachable"), r.stdout + r.stderr
    assert f"hf download zhuzilin/aime-2024 --repo-type dataset --local-dir {tmp_path / 'aime'}" in r.stdout


def test_a_completed_download_is_skipped(tmp_path, monkeypatch):
    from miles.prepare.runner import run_prepare_steps

    module = RECIPES["qwen3-4b"]
    options = module.Options(model_dir=str(tmp_path / "m"), data_dir=str(tmp_path / "d"))
    steps = module.plan(options).prepare
    assert [s.name for s in steps] == ["download-model", "download-dapo-math-17k", "download-aime-2024"]
    for step in steps:
        Path(step.sentinel).parent.mkdir(parents=True)
        Path(step.sentinel).write_text("done\n")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # a download attempt would raise
    run_prepare_steps(steps)


def test_the_memory_plan_counts_an_opd_teacher_at_the_size_its_config_json_says(tmp_path):
    """qwen3-4b (TP2, bf16) distilling from a Qwen3-30B-A3B teacher (--opd-type megatron): the teacher's
    30.5B frozen parameters, split like the actor's (dense / TP2, experts whole), in bf16 = 55.4 GiB
    per GPU, which no longer fits an H100; expert parallelism is not offered for the dense student."""
    from recipes.catalog.models import QWEN3_30B_A3B

    teacher = tmp_path / "teacher"
    teacher.mkdir()
    (teacher / "config.json").write_text(json.dumps(QWEN3_30B_A3B))
    r = dry_run(tmp_path, "full-train", "--model-name", "qwen3-4b", "--use-opd", "--opd-type", "megatron",
                "--opd-teacher-load", str(teacher))
    assert "trainer OPD teacher: 55.4 GiB" in r.stdout and "OPD teacher: 30.53B frozen parameters × 2 bytes" in r.stdout
    assert "DOES NOT FIT" in r.stdout and "--expert-model-parallel-size" not in r.stdout.split("would fit with:")[-1]
    unread = dry_run(tmp_path, "full-train", "--model-name", "qwen3-4b", "--use-opd", "--opd-type", "megatron",
                     "--opd-teacher-load", str(tmp_path / "missing"))
    assert "(its config.json unread: counted at the student's size)" in unread.stdout
