"""`--device auto|cpu|cuda` to the device a run uses, asked of torch only where a GPU could be there.

The driver picks the device before it starts any actor (it decides their resources), and it imports
no torch otherwise: on a machine with no GPU device node (`/dev/nvidiactl`, `/dev/kfd` for ROCm,
`/dev/dxg` under WSL) CUDA cannot be available, so `auto` is the CPU without importing torch
(~230 MB and ~2 s of CPU in a process that computes nothing). Anywhere else torch decides, as before.
"""

from __future__ import annotations

import os

from miles.errors import UserError

# A CUDA (or ROCm) device is visible to a process only through one of these.
GPU_DEVICE_NODES = ("/dev/nvidiactl", "/dev/nvidia0", "/dev/kfd", "/dev/dxg")


def _cuda_available() -> bool:
    if not any(os.path.exists(p) for p in GPU_DEVICE_NODES):
        return False
    import torch

    return torch.cuda.is_available()


def pick_device(device: str) -> str:
    if device == "auto":
        return "cuda" if _cuda_available() else "cpu"
    if device == "cuda" and not _cuda_available():
        raise UserError("--device cuda was given but no CUDA device is visible; use --device cpu or auto.", option="--device")
    return device
