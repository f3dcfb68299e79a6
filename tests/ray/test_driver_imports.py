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
