"""Every benchmark runs at its smoke-test size (`--tiny`) and writes the goal rows bench/run_all.py reads.

Not a speed test (speed targets live in bench/ and docs/benchmarks.md): these catch a benchmark that
no longer runs against the current code (a renamed trainer argument, a changed engine call) or that
writes rows run_all cannot print. Each one is a few fresh interpreters, so seconds on a quiet machine.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


def run_bench(name: str, tmp_path: Path, *extra: str, timeout: int = 600) -> list[dict]:
    out = tmp_path / f"{name}.json"
    r = subprocess.run([sys.executable, str(ROOT / "bench" / f"{name}.py"), "--tiny", "--json", str(out), *extra],
                       cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert rows, f"{name} wrote no rows"
    for row in rows:
        assert set(row) >= {"what", "value", "unit", "goal", "met"}, row
    return rows


def finite_positive(rows: list[dict]) -> bool:
    return all(isinstance(r["value"], float) and math.isfinite(r["value"]) and r["value"] > 0 for r in rows)


def test_cli_help(tmp_path):
    rows = run_bench("cli_help", tmp_path)
    assert [r["goal"] for r in rows[:2]] == ["<= 1.5", "<= 2"] and finite_positive(rows)


def test_convert(tmp_path):
    rows = run_bench("convert", tmp_path, "--dir", str(tmp_path / "work"))
    assert rows[0]["what"].startswith("convert HF->torch_dist vs cp") and finite_positive(rows[:1])
    # The memory row: peak RSS above an idle interpreter, as a share of (largest tensor + 1 GB).
    assert rows[2]["met"] is True


def test_train_step(tmp_path):
    rows = run_bench("train_step", tmp_path)
    assert finite_positive(rows)


def test_lora(tmp_path):
    rows = run_bench("lora", tmp_path)
    assert finite_positive(rows) and len(rows) == 3


def test_memory_plan(tmp_path):
    rows = run_bench("memory_plan", tmp_path)
    assert finite_positive(rows) and all(r["unit"] == "x measured" for r in rows)


def test_rollout_engine(tmp_path):
    rows = run_bench("rollout_engine", tmp_path)
    assert finite_positive(rows)


def test_step_phases(tmp_path):
    rows = run_bench("step_phases", tmp_path)
    phases = json.loads((tmp_path / "step_phases.json").read_text())["in_process"]
    assert {"generation", "reward (decode + exact match)", "weight update (in process)"} <= set(phases)
    assert all(v >= 0 for v in phases.values()) and 0 < rows[0]["value"] < 1


def test_startup(tmp_path):
    rows = run_bench("startup", tmp_path, "--no-real-run")
    by = {r["what"]: r for r in rows}
    assert {"start-up: ray.init: a private local node", "start-up: import torch",
            "start-up: rollout manager set-up (engine, datasets; imports included)",
            "start-up: trainer set-up (model, optimizer; imports included)"} <= set(by)
    assert finite_positive(rows) and all(r["process_s"] >= r["value"] for r in rows)


def test_run_all_smoke_sizes_cover_every_benchmark():
    """`run_all.py --tiny` passes each benchmark its smoke-test size: `--tiny`, or what TINY names
    for a benchmark without that flag; every benchmark must accept what it is given."""
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import run_all
    finally:
        sys.path.remove(str(ROOT / "bench"))
    assert {"vs_trl", "startup", "async_overlap", "step_phases"} <= set(run_all.BENCHES)
    for name in run_all.BENCHES:
        args = run_all.TINY.get(name, ["--tiny"]) + run_all.BENCHES[name]
        r = subprocess.run([sys.executable, str(ROOT / "bench" / f"{name}.py"), "--help"], env=ENV, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr[-2000:]
        assert all(arg in r.stdout for arg in args if arg.startswith("--")), (name, args)


@pytest.mark.skipif(importlib.util.find_spec("trl") is None, reason="TRL is the bench-only extra: pip install -e '.[bench]'")
def test_vs_trl(tmp_path):
    rows = run_bench("vs_trl", tmp_path, "--keep", str(tmp_path / "work"), timeout=900)
    by = {r["what"]: r for r in rows}
    assert by["RL loop steps/s vs TRL GRPOTrainer"]["value"] > 0
    assert by["start to first RL step vs TRL"]["value"] > 0
    # Both sides evaluated the held-out split before the first step and after the last (3 steps, every 2).
    log = (tmp_path / "work" / "runs" / "vs-trl" / "metrics.jsonl").read_text().splitlines()
    assert sum('"eval/arith/accuracy"' in line for line in log) >= 2
    # TRL ran at its default threads (the goals' baseline) and at one thread (reported beside it).
    assert "RL loop steps/s vs TRL GRPOTrainer (TRL 1 thread)" in by
    # Generation alone, the engine against `generate` on the rollout's batch: a like-for-like ratio.
    assert by["built-in engine vs HF generate, the rollout's batch, generation alone"]["value"] > 0


def test_vs_trl_over_seeds_takes_each_ratios_median_and_compares_learning_per_step():
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import vs_trl
    finally:
        sys.path.remove(str(ROOT / "bench"))
    rows = [{"what": f"RL loop steps/s vs TRL GRPOTrainer [seed {s}]", "value": v, "unit": "x TRL", "goal": ">= 2", "met": False}
            for s, v in ((0, 1.2), (1, 2.4), (2, 1.5))]
    rows += [{"what": f"RL loop wall time to held-out 0.4 vs TRL [seed {s}]", "value": v, "unit": "x TRL", "goal": "<= 0.5", "met": None}
             for s, v in ((0, 0.4), (1, None), (2, 0.3))]
    med = vs_trl.over_seeds(rows, [0, 1, 2])
    assert [(r["what"], r["value"], r["met"]) for r in med] == [
        ("RL loop steps/s vs TRL GRPOTrainer (median of seeds 0, 1, 2)", 1.5, False),
        ("RL loop wall time to held-out 0.4 vs TRL (median of seeds 0, 1, 2)", None, None),  # one seed never got there
    ]
    assert vs_trl.meets(0.5, "<= 0.5") and vs_trl.meets(2.0, ">= 2") and not vs_trl.meets(1.99, ">= 2")
    finals = {"miles": [0.5, 0.4, 0.6], "TRL default": [0.4, 0.5, None], "TRL 1 thread": [0.6, 0.5, 0.4]}
    learn = vs_trl.learning_rows(finals, type("A", (), {"steps": 150})())
    assert [r["what"] for r in learn] == [
        "held-out after step 150, mean (range) of 3 seeds: miles 0.500 (0.400-0.600) vs TRL default 0.450 (0.400-0.500)",
        "held-out after step 150, mean (range) of 3 seeds: miles 0.500 (0.400-0.600) vs TRL 1 thread 0.500 (0.400-0.600)",
    ]
    assert [round(r["value"], 6) for r in learn] == [round(0.5 / 0.45, 6), 1.0]


# The bench extra hidden from the script as if it were not installed (a None in sys.modules is what
# importlib.util.find_spec reports as missing), so this runs whether or not this venv has it.
_WITHOUT = """
import runpy, sys
for name in sys.argv[1].split(","):
    if name:
        sys.modules[name] = None
sys.argv = sys.argv[2:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.mark.parametrize("hidden", ["trl,datasets", "datasets"])
def test_vs_trl_without_the_bench_extra_says_how_to_install_it(tmp_path, hidden):
    r = subprocess.run([sys.executable, "-c", _WITHOUT, hidden, str(ROOT / "bench" / "vs_trl.py"), "--tiny"], cwd=tmp_path, env=ENV,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
    assert 'pip install -e ".[bench]"' in r.stderr and "Traceback" not in r.stderr
    assert all(name in r.stderr for name in hidden.split(","))  # names what is missing
    assert not list(tmp_path.iterdir())  # refused before preparing anything


def test_vs_trl_rejects_a_bad_thread_setting(tmp_path):
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "vs_trl.py"), "--tiny", "--trl-threads", "two"], cwd=tmp_path,
                       env=ENV, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--trl-threads" in r.stderr and "Traceback" not in r.stderr


def test_run_all_prints_one_table(tmp_path):
    out = tmp_path / "all.json"
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "run_all.py"), "--tiny", "--only", "cli_help", "--json", str(out)],
                       cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    table = r.stdout[r.stdout.rindex("what"):]
    assert "miles --help vs python -c 'import typer'" in table and "<= 1.5" in table
    assert json.loads(out.read_text())["rows"][0]["bench"] == "cli_help"
