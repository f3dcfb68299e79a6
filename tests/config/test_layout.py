"""The run layout (miles/config/layout.py): derived once by resolve(), stored on the config, shown by
--dry-run; the arithmetic the placement group and the driver use."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest

from miles.config.layout import run_layout
from miles.config.resolve import build_config, resolve, resolve_device, resolve_num_rollout

BASE = {"prompt_data": "x.jsonl", "rollout_batch_size": 4, "n_samples_per_prompt": 2, "num_rollout": 3, "actor_num_gpus_per_node": 1}


def config(**values):
    return resolve(build_config({**BASE, **values}, environ={}))


def test_resolve_stores_the_layout_once():
    cfg = config(actor_num_gpus_per_node=2, rollout_num_gpus=3, global_batch_size=8)
    stored = cfg.layout
    assert stored is cfg.layout  # stored, not recomputed on each read
    assert (stored.train_ranks, stored.engine_servers, stored.engines.num_engines, stored.engine_bundles) == (2, True, 3, 3)
    assert stored.bundles == 5  # a bundle per rank, then one per engine device
    assert stored.num_rollout == 3


@pytest.mark.parametrize("values, bundles", [
    ({}, 2),  # one rank and the in-process engine beside it
    ({"colocate": True}, 1),
    ({"colocate": True, "rollout_num_gpus": 2}, 2),  # two engine devices never share one rank's bundle
    ({"colocate": True, "actor_num_gpus_per_node": 4, "global_batch_size": 8}, 4),
])
def test_bundles(values, bundles):
    assert config(**values).layout.bundles == bundles


def test_offload_takes_effect_only_on_a_gpu():
    cfg = config(colocate=True, offload_train=True, offload_rollout=True)
    assert cfg.layout.device == "auto" and cfg.layout.offload_train is None  # undecided until the run picks
    assert resolve_device(cfg, "cpu").layout.offload_train is False
    on_gpu = resolve_device(cfg, "cuda").layout
    assert (on_gpu.device, on_gpu.offload_train, on_gpu.offload_rollout) == ("cuda", True, True)


def test_num_epoch_fills_num_rollout_and_the_layout():
    cfg = resolve(build_config({**BASE, "num_rollout": None, "num_epoch": 2}, environ={}))
    assert cfg.layout.num_rollout is None
    resolve_num_rollout(cfg, 12)  # 12 prompts, 4 a step, 2 epochs
    assert cfg.data.num_rollout == cfg.layout.num_rollout == 6


def test_sglang_layout_is_the_engine_layout():
    cfg = build_config({**BASE, "rollout_backend": "sglang", "actor_num_gpus_per_node": 8, "rollout_num_gpus": 32,
                        "rollout_num_gpus_per_engine": 16}, environ={})
    layout = run_layout(cfg)
    assert (layout.engines.num_engines, layout.engines.gpus_per_engine, layout.engines.nodes_per_engine) == (2, 16, 2)
    assert layout.engine_bundles == 32 and layout.bundles == 40


def test_an_unresolved_config_has_the_layout_of_its_values():
    from miles.config.engine import EngineConfig

    cfg = EngineConfig()
    cfg.cluster.actor_num_gpus_per_node = 3
    assert cfg.layout.train_ranks == 3
    assert dataclasses.replace(cfg).layout.train_ranks == 3


def test_dry_run_prints_the_resolved_line(tmp_path):
    env = {**os.environ, "COLUMNS": "200", "NO_COLOR": "1"}
    r = subprocess.run([sys.executable, "-m", "miles_cli.main", "train", "--dry-run", "--extra-args", "--rollout-num-gpus 2 --num-rollout 7"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180)
    line = next((x for x in r.stdout.splitlines() if x.startswith("Resolved:")), None)
    assert line is not None, r.stdout[-3000:] + r.stderr[-2000:]
    assert "1 training rank(s); 2 engine server(s) × 1 device(s)" in line and "(colocated with the trainer); 2 placement bundle(s)" in line and "num_rollout 7" in line
