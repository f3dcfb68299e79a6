"""The run's driver imports no torch on a machine without a GPU: it only orders the actors' work.

A driver with torch held ~240 MB more (540 against ~340 MB peak RSS in a default run) and spent ~2 s
of CPU on imports while Ray's node started beside it on the same cores. What the driver imports:
the CLI's run path (`miles.ray.driver`, `cluster`, the actor classes, `TrainGroup`, the weight-sync
ordering, the checkpoint tracker, the tracking sinks) and `pick_device("auto")`.
"""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from miles.errors import UserError
from miles.ray import device as device_mod

_NO_GPU_NODES = not any(os.path.exists(p) for p in device_mod.GPU_DEVICE_NODES)

_CHILD = textwrap.dedent("""
    import sys
    import miles.ray.driver, miles.ray.cluster, miles.ray.actors, miles.ray.train_group, miles.ray.weight_sync
    import miles.ckpt.trainer_checkpoint, miles.ray.placement, miles.ray.hosting, miles.tracking.tracker
    import miles.tracking.console, miles.train.metrics
    from miles.ray.device import pick_device
    print(pick_device("auto"), sorted(m for m in ("torch", "transformers") if m in sys.modules))
""")


@pytest.mark.skipif(not _NO_GPU_NODES, reason="a GPU device node exists here: torch decides the device, so the driver imports it")
def test_the_driver_picks_the_cpu_and_defines_its_actors_without_importing_torch():
    out = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split("\n")[-2] == "cpu []"


def test_without_a_gpu_device_node_auto_is_the_cpu_and_cuda_is_refused(monkeypatch):
    monkeypatch.setattr(device_mod, "GPU_DEVICE_NODES", ("/nonexistent/nvidiactl",))
    assert device_mod.pick_device("auto") == "cpu"
    assert device_mod.pick_device("cpu") == "cpu"
    with pytest.raises(UserError, match="--device cuda"):
        device_mod.pick_device("cuda")


def test_with_a_gpu_device_node_torch_decides(monkeypatch, tmp_path):
    node = tmp_path / "nvidiactl"
    node.write_text("")
    monkeypatch.setattr(device_mod, "GPU_DEVICE_NODES", (str(node),))
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert device_mod.pick_device("auto") == "cuda"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert device_mod.pick_device("auto") == "cpu"


_MLFLOW_CHILD = textwrap.dedent("""
    import contextlib, sys, threading
    from recipes import tiny_qwen3
    from miles.config.resolve import build_config, resolve
    import miles.ray.cluster as cluster
    from miles.ray.driver import run_training

    W = sys.argv[1]
    opts = tiny_qwen3.Options(output_dir=W + "/runs", model_dir=W + "/models", data_dir=W + "/data", run_id="t", sft_steps=2)
    cfg = resolve(build_config(dict(tiny_qwen3.plan(opts).engine), environ={}))
    assert cfg.tracking.use_mlflow

    class Up(Exception):
        pass

    @contextlib.contextmanager
    def cluster_up(cfg, *, run_dir, env, stack=None):
        # Where the real start_cluster has Ray's node and the actors up: whatever the driver started on
        # threads before it has finished by now (joined), so an MLflow import begun early would show.
        for t in threading.enumerate():
            if t is not threading.current_thread():
                t.join(120)
        print("mlflow imported before the actors were up:", "mlflow" in sys.modules)
        raise Up
        yield

    cluster.start_cluster = cluster_up
    try:
        run_training(cfg, run_dir=W + "/runs/t", run_id="t")
    except Up:
        pass
""")


def test_the_driver_leaves_mlflow_until_the_actors_are_up(tmp_path):
    # MLflow's imports are ~5 s of CPU; begun on a thread before `ray.init` they took a core from Ray's
    # start and the actors' set-up on a 2-core machine. The Tracker's writer thread opens it instead.
    root = str(Path(__file__).resolve().parents[2])  # the recipes package
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (root, os.environ.get("PYTHONPATH"))))}
    out = subprocess.run([sys.executable, "-c", _MLFLOW_CHILD, str(tmp_path)], capture_output=True, text=True, timeout=240, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "mlflow imported before the actors were up: False" in out.stdout, out.stdout[-2000:]
