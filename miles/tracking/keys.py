"""Metric-key and parameter transforms for the sinks that restrict names (MLflow, Prometheus, wandb).

Miles metric names are `/`-separated (`rollout/raw_reward`, `eval/gsm8k/accuracy`); the JSONL file
and TensorBoard keep them verbatim. The other sinks need these mappings (each is documented in
docs/monitoring.md, and tests/tracking/test_keys.py pins them):

- `mlflow_key`: MLflow (3.x, POSIX) accepts alphanumerics, `_ - . / : ` and space, and rejects names
  that `posixpath.normpath` would change (`a//b`, `a/./b`, leading `/`, trailing `/`). Any other
  character becomes `_`; empty segments are dropped; a `.` or `..` segment becomes `_` or `__`;
  the result is cut to 250 characters. `rollout/raw_reward` is unchanged.
- `prometheus_name`: `miles_metric_` + the key with `/` and `-` → `_`, `@` → `_at_` (the names
  upstream miles uses), and any other character outside `[A-Za-z0-9_:]` → `_`.
- `wandb_run_id`: wandb ids allow `[A-Za-z0-9_-]`; other characters become `-`, cut to 64.
- `flatten_params`: nested dicts and dataclasses become `group.field` keys with string values
  (MLflow params are strings), values longer than MLflow's 6000-character limit are cut with a
  marker, and dataclass fields declared `secret=True` (see miles/config/fields.py) are masked.

Pure functions, stdlib only.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping
from typing import Any

MLFLOW_MAX_KEY_LENGTH = 250
MLFLOW_MAX_PARAM_VALUE_LENGTH = 6000
SECRET_MASK = "***"

_MLFLOW_BAD = re.compile(r"[^\w\-. :/]", re.ASCII)
_PROM_BAD = re.compile(r"[^A-Za-z0-9_:]")
_WANDB_BAD = re.compile(r"[^A-Za-z0-9_-]")


def _path_safe(name: str) -> str:
    segments = []
    for seg in name.split("/"):
        if seg == "":
            continue  # `a//b`, leading or trailing `/`: normpath would change the name
        if set(seg) == {"."} and len(seg) <= 2:
            seg = "_" * len(seg)  # `.` / `..` segments are path navigation for normpath
        segments.append(seg)
    return "/".join(segments)


def mlflow_key(key: str) -> str:
    """`key` rewritten to a name MLflow accepts (see the module docstring for the exact rule)."""
    # Cutting can leave a trailing `/` or a `.` segment, so make the cut result path-safe again
    # (that only drops or replaces characters, so it stays within the limit).
    name = _path_safe(_path_safe(_MLFLOW_BAD.sub("_", key))[:MLFLOW_MAX_KEY_LENGTH])
    return name or "_"


def prometheus_name(key: str) -> str:
    """The gauge name of metric `key`: `miles_metric_rollout_raw_reward` for `rollout/raw_reward`."""
    body = key.replace("/", "_").replace("-", "_").replace("@", "_at_")
    return "miles_metric_" + _PROM_BAD.sub("_", body)


def wandb_run_id(run_id: str) -> str:
    """A wandb run id derived from the miles run id, so a resumed miles run resumes its wandb run."""
    return _WANDB_BAD.sub("-", run_id)[:64] or "miles"


def _stringify(value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, (list, tuple)):
        try:
            return json.dumps(list(value))
        except TypeError:
            return repr(value)
    return str(value)


def _cut(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    marker = f"...[cut, {len(text)} chars]"
    return text[: limit - len(marker)] + marker


def flatten_params(params: Mapping[str, Any] | Any, *, prefix: str = "") -> dict[str, str]:
    """Nested dicts/dataclasses → `{"group.field": "value"}`, values stringified and cut to MLflow's limit.

    `None` becomes `"None"`, lists become JSON (`[1, 2]`). Dataclass fields whose metadata says
    `secret` are replaced by `***` so that keys and tokens never reach a tracking server.
    """
    out: dict[str, str] = {}
    if dataclasses.is_dataclass(params) and not isinstance(params, type):
        items = []
        for f in dataclasses.fields(params):
            value = getattr(params, f.name)
            if f.metadata.get("secret") and value is not None:
                value = SECRET_MASK
            items.append((f.name, value))
    else:
        items = list(params.items())
    for name, value in items:
        key = f"{prefix}{name}"
        is_nested = isinstance(value, Mapping) or (dataclasses.is_dataclass(value) and not isinstance(value, type))
        if is_nested:
            out.update(flatten_params(value, prefix=key + "."))
        else:
            out[key] = _cut(_stringify(value), MLFLOW_MAX_PARAM_VALUE_LENGTH)
    return out
