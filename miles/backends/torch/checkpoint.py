"""Per-rank distributed checkpoints of the torch backend with `torch.distributed.checkpoint` (DCP).

One DCP checkpoint in the directory the driver prepared (the temporary directory of the atomic
tracker protocol, miles/ckpt/trainer_checkpoint.py) holds:

- `model`: the HF-named weights, keyed by parameter name (DCP writes a replicated tensor once);
- `optimizer`: AdamW state keyed by parameter name (`get_state_dict`), so it loads whatever the
  world size;
- `scheduler.num_steps`: the LR schedule's one integer;
- `rng_rank_<r>`: every rank's generators (torch, numpy, python, CUDA), as tensors.

Every rank calls `save`/`load` (they are collectives when a process group exists); each writes its
own `__<rank>_0.distcp` file. A resume on a different number of ranks loads model and optimizer
(resharded by DCP); ranks that had no RNG entry keep their seeded generators, with a warning.

`read_model_weights(directory)` (no process group, no model needed) returns the full HF-named
weights, for `miles eval` and exports.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from miles.backends.torch.optim import StepCounter
from miles.backends.torch.rng import rng_state_tensors, set_rng_state_tensors

logger = logging.getLogger(__name__)

METADATA = ".metadata"


def _no_dist() -> bool:
    # Without a process group DCP reads/writes in this process alone (and would warn about it).
    return not (torch.distributed.is_available() and torch.distributed.is_initialized())


@contextlib.contextmanager
def _single_process_quietly():
    """DCP warns on every save/load of a one-worker run that it assumes a single process, which is
    exactly what a one-worker run is; on the run's console that warning is noise."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to (save|load) in a single process")
        yield


def _rng_key(rank: int) -> str:
    return f"rng_rank_{rank}"


def save(directory: str, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: StepCounter, rank: int) -> None:
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {
        "model": model_sd,
        "optimizer": optim_sd,
        "scheduler": {"num_steps": torch.tensor(scheduler.num_steps, dtype=torch.int64)},
        _rng_key(rank): rng_state_tensors(),
    }
    with _single_process_quietly():
        dcp.save(state, checkpoint_id=directory, no_dist=_no_dist())


def saved_keys(directory: str) -> set[str]:
    """The flattened keys stored in a DCP checkpoint (e.g. `model.lm_head.weight`)."""
    return set(dcp.FileSystemReader(directory).read_metadata().state_dict_metadata)


def load(directory: str, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: StepCounter, rank: int) -> None:
    if not (Path(directory) / METADATA).is_file():
        raise FileNotFoundError(f"{directory} is not a torch.distributed.checkpoint directory (no {METADATA})")
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state: dict = {
        "model": model_sd,
        "optimizer": optim_sd,
        "scheduler": {"num_steps": torch.tensor(0, dtype=torch.int64)},
    }
    has_rng = any(k.startswith(_rng_key(rank) + ".") for k in saved_keys(directory))
    if has_rng:
        state[_rng_key(rank)] = rng_state_tensors()  # a template of the right shapes, filled in place
    else:
        logger.warning("%s holds no RNG state for rank %d (saved with fewer ranks); keeping its seeded generators", directory, rank)
    with _single_process_quietly():
        dcp.load(state, checkpoint_id=directory, no_dist=_no_dist())
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    scheduler.load_state_dict({"num_steps": int(state["scheduler"]["num_steps"])})
    if has_rng:
        set_rng_state_tensors(state[_rng_key(rank)])


def read_model_weights(directory: str) -> dict[str, torch.Tensor]:
    """The full `model.*` tensors of a DCP checkpoint by HF name, read in this process alone."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    meta = dcp.FileSystemReader(directory).read_metadata().state_dict_metadata
    template = {
        key[len("model.") :]: torch.empty(m.size, dtype=m.properties.dtype)
        for key, m in meta.items()
        if key.startswith("model.") and isinstance(m, TensorStorageMetadata)
    }
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
        dcp.load({"model": template}, checkpoint_id=directory, no_dist=True)
    return template
