"""The SGLang release miles is built against, as data every layer may read: its version pins and the
checked-in `ServerArgs` / sglang-router `RouterArgs` field snapshots.

- `SGLANG_VERSION`, `SGLANG_ROUTER_VERSION`: the one SGLang release miles drives. The docker images
  (docker/install_miles.py reads this file by path), `requirements/gpu.txt` and the field snapshots all
  name this version; tests/sglang_backend/test_sglang_install.py checks that they agree.
- `server_args.json`, `router_args.json`: one entry per field (name, SGLang's flag, kind, default,
  choices, help), from which miles/config/sglang.py generates the `--sglang-*` and `--sglang-router-*`
  options. `python -m miles.rollout.sglang.snapshot` regenerates them from the pinned wheels.

Below config and rollout alike (both read it); importing it is free: no torch, no sglang.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

SGLANG_VERSION = "0.5.23"
SGLANG_ROUTER_VERSION = "0.3.2"

HERE = Path(__file__).resolve().parent
SERVER_ARGS_FILE = HERE / "server_args.json"
ROUTER_ARGS_FILE = HERE / "router_args.json"


@functools.cache
def server_fields() -> tuple[dict[str, Any], ...]:
    """The pinned `ServerArgs` fields that have a command-line flag, in SGLang's order."""
    data = json.loads(SERVER_ARGS_FILE.read_text())
    return tuple(data["fields"])


@functools.cache
def router_fields() -> tuple[dict[str, Any], ...]:
    """The pinned `RouterArgs` options, in the router's `--help` order."""
    data = json.loads(ROUTER_ARGS_FILE.read_text())
    return tuple(data["fields"])


def snapshot_version(path: Path) -> str:
    return json.loads(path.read_text())["version"]
