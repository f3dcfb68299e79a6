"""Whether the hardware a run asks for is on this machine, checked before anything starts.

`--hardware H100` (or any GPU name) means: train and generate on NVIDIA GPUs. On a machine where none
is visible that is a user error (exit 2, one sentence), never a silent run on the CPU; `--hardware
auto` is the one value that falls back. A run on an existing Ray cluster (`--ray-address`) is not
checked here: the GPUs are the cluster's, which Ray places.

GPUs are counted without importing torch (the dry run stays fast): NVIDIA's device files
(`/dev/nvidia0`, ...), limited by `CUDA_VISIBLE_DEVICES` as CUDA limits them.
"""

from __future__ import annotations

import glob
import os
import re

from miles.errors import UserError

GPU_HARDWARE = ("H100", "H200", "B200", "GB200")


class MissingHardware(UserError):
    """The hardware a run asks for is not on this machine (`miles docs check` tells it apart: a
    documented GPU command is checked on machines without GPUs)."""


def visible_gpus() -> int:
    """How many NVIDIA GPUs a process started here would see."""
    found = len([p for p in glob.glob("/dev/nvidia*") if re.fullmatch(r"/dev/nvidia\d+", p)])
    mask = os.environ.get("CUDA_VISIBLE_DEVICES")
    if mask is None:
        return found
    ids = []
    for item in mask.split(","):
        item = item.strip()
        if not item or item.startswith("-"):
            break  # CUDA ignores every id from the first invalid one on
        ids.append(item)
    return min(found, len(ids))


def check_hardware_present(hardware: str, *, ray_address: str | None) -> None:
    """Raise `MissingHardware` when `--hardware` names GPUs and this machine shows none (see module doc)."""
    if hardware not in GPU_HARDWARE or ray_address:
        return
    if visible_gpus() == 0:
        hidden = " (CUDA_VISIBLE_DEVICES hides them)" if os.environ.get("CUDA_VISIBLE_DEVICES") is not None and glob.glob("/dev/nvidia[0-9]*") else ""
        raise MissingHardware(
            f"--hardware {hardware} asks for NVIDIA GPUs but this machine has none visible{hidden}; "
            "pass --hardware cpu to run on the CPU, or run it where the GPUs are (--ray-address for a Ray cluster).",
            option="--hardware",
        )


def device_summary(device: str) -> str:
    """What `--dry-run` says the run will use: the device the run resolves `auto` to here."""
    if device == "cpu" or (device == "auto" and visible_gpus() == 0):
        return "cpu"
    return "cuda"
