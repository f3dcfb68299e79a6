"""Checks `miles train|full-train --rollout-backend sglang` makes before it starts anything.

Each failure is a user error (exit 2, one sentence): not enough GPUs for the plan, or SGLang missing
or at another version in the interpreter that would run the servers. `--dry-run` skips these
checks, so the plan of a 64-GPU recipe can be read on a laptop.
"""

from __future__ import annotations

import subprocess
from typing import Any

from miles.errors import UserError
from miles.rollout.sglang import SGLANG_VERSION
from miles.rollout.sglang.launch import engine_layout, server_command

PROBE_TIMEOUT_S = 300.0  # importing SGLang takes 10-20 s, minutes on a loaded machine
INSTALL_HINT = "install it with the GPU command in README.md (pip install -r requirements/gpu.txt && pip install --no-deps -e .)"


def gpus_needed(cfg: Any) -> tuple[int, str]:
    """(GPUs, a phrase saying why) that the run's placement asks for."""
    c = cfg.cluster
    layout = engine_layout(cfg)
    train = c.actor_num_nodes * c.actor_num_gpus_per_node
    rollout = layout.num_engines * layout.gpus_per_engine
    if c.colocate:
        return max(train, rollout), f"{train} training GPUs shared with {layout.num_engines} SGLang engine(s) of {layout.gpus_per_engine}"
    return train + rollout, f"{train} training GPUs + {layout.num_engines} SGLang engine(s) of {layout.gpus_per_engine}"


def visible_gpus() -> int:
    import torch

    return torch.cuda.device_count()


def installed_sglang_version(command: list[str], *, timeout_s: float = PROBE_TIMEOUT_S) -> str | None:
    """`sglang.__version__` in the interpreter of `<python> -m sglang.launch_server`, None if not importable."""
    probe = [command[0], "-c", "import sglang; print(sglang.__version__)"]
    try:
        done = subprocess.run(probe, capture_output=True, text=True, timeout=timeout_s, check=False)
    except FileNotFoundError:
        return None
    except subprocess.TimeoutExpired:
        raise UserError(f"`{' '.join(probe)}` did not finish within {timeout_s:g} s; check that SGLang environment.") from None
    return done.stdout.strip() if done.returncode == 0 else None


def check_can_launch(cfg: Any, *, gpus: int | None = None) -> None:
    needed, why = gpus_needed(cfg)
    # On a cluster Ray counts the GPUs when it places the actors; with --device cpu every "GPU" is a
    # CPU process (the engines get CUDA_VISIBLE_DEVICES="").
    if not cfg.cluster.ray_address and cfg.cluster.device != "cpu":
        have = visible_gpus() if gpus is None else gpus
        if have < needed:
            raise UserError(
                f"--rollout-backend sglang needs {needed} GPUs here ({why}) but {have} are visible; run on a machine "
                "or Ray cluster (--ray-address) that has them, add --device cpu for CPU servers, or add --dry-run "
                "to print the plan.",
                option="--rollout-backend",
            )
    command = server_command(cfg)
    if command[1:3] == ["-m", "sglang.launch_server"]:
        version = installed_sglang_version(command)
        if version != SGLANG_VERSION:
            found = "is not installed" if version is None else f"is version {version}"
            raise UserError(
                f"SGLang {found} in {command[0]}, and miles drives SGLang {SGLANG_VERSION}; {INSTALL_HINT}, "
                "or point --sglang-server-command at an environment that has it.",
                option="--sglang-server-command",
            )
