"""Seeding, deterministic mode, and RNG states as plain tensors and lists.

The RNG states (torch CPU, torch CUDA when present, numpy, python `random`) are stored as tensors and
lists only, so a checkpoint loads with `torch.load(weights_only=True)` (no pickle of arbitrary
objects) and a restore puts every generator back exactly where it was.

Use: `seed_everything(1234, deterministic=True)`; `state = get_rng_state()`; `set_rng_state(state)`.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def seed_everything(seed: int, *, deterministic: bool) -> None:
    """Seed torch, numpy and python; with `deterministic`, also make torch refuse nondeterministic ops.

    Deterministic mode is process-wide (it is a torch global). On CPU, bit-equal results also need the
    same number of torch threads in the runs being compared.
    """
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    if deterministic:
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.benchmark = False


def get_rng_state() -> dict[str, Any]:
    """Every generator's state, as tensors and lists (loadable with weights_only=True)."""
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    py_version, py_internal, py_gauss = random.getstate()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": {
            "name": str(np_name),
            "keys": torch.from_numpy(np.asarray(np_keys, dtype=np.int64)),
            "pos": int(np_pos),
            "has_gauss": int(np_has_gauss),
            "cached_gaussian": float(np_gauss),
        },
        "python": {"version": int(py_version), "internal": list(py_internal), "gauss_next": py_gauss},
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what `get_rng_state` returned."""
    torch.set_rng_state(state["torch"])
    n = state["numpy"]
    np.random.set_state(
        (n["name"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached_gaussian"])
    )
    p = state["python"]
    random.setstate((p["version"], tuple(p["internal"]), p["gauss_next"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def rng_state_tensors() -> dict[str, torch.Tensor]:
    """`get_rng_state()` flattened to tensors only (a torch.distributed.checkpoint entry per rank)."""
    state = get_rng_state()
    n, p = state["numpy"], state["python"]
    gauss = p["gauss_next"]
    out = {
        "torch": state["torch"],
        "numpy_keys": n["keys"],
        "numpy_rest": torch.tensor([n["pos"], n["has_gauss"]], dtype=torch.int64),
        "numpy_gauss": torch.tensor([n["cached_gaussian"]], dtype=torch.float64),
        "python_internal": torch.tensor(p["internal"], dtype=torch.int64),
        "python_rest": torch.tensor([p["version"], gauss is not None], dtype=torch.int64),
        "python_gauss": torch.tensor([0.0 if gauss is None else gauss], dtype=torch.float64),
    }
    for i, s in enumerate(state.get("cuda", [])):
        out[f"cuda_{i}"] = s
    return out


def set_rng_state_tensors(t: dict[str, torch.Tensor]) -> None:
    """Restore what `rng_state_tensors` returned."""
    rest, prest = t["numpy_rest"].tolist(), t["python_rest"].tolist()
    state: dict[str, Any] = {
        "torch": t["torch"],
        "numpy": {"name": "MT19937", "keys": t["numpy_keys"], "pos": rest[0], "has_gauss": rest[1], "cached_gaussian": float(t["numpy_gauss"][0])},
        "python": {
            "version": prest[0],
            "internal": t["python_internal"].tolist(),
            "gauss_next": float(t["python_gauss"][0]) if prest[1] else None,
        },
    }
    cuda = [t[k] for k in sorted((k for k in t if k.startswith("cuda_")), key=lambda k: int(k[5:]))]
    if cuda:
        state["cuda"] = cuda
    set_rng_state(state)
