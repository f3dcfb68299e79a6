"""Save and load the megatron trainer's state: `dist_checkpointing` (torch_dist) plus one file per rank.

Layout of a checkpoint directory (the caller's temporary dir of the atomic tracker protocol):

    metadata.json, common.pt, __*_*.distcp, .metadata   model + optimizer, megatron-core torch_dist
    rank_00000.pt, rank_00001.pt, ...                    per rank: RNG states, optimizer step count
    miles_megatron.json                                  format, parallel layout, vocab padding

Every rank writes its own shards (megatron-core's `dist_checkpointing.save` is collective). The
model part is the same torch_dist layout `miles convert` writes and reads, so a training checkpoint
converts to HF (`miles convert --from torch_dist --to hf`).

The distributed optimizer (`--use-distributed-optimizer`) without TransformerEngine/Apex has three
known checkpoint bugs in megatron-core 0.16.1, each worked around here:

1. a fresh optimizer has no Adam state yet, so its sharded state dict for loading is empty and a
   load silently restores nothing: `_materialise_state` runs `init_state_fn` on the inner torch
   optimizer before building the state dict;
2. the inner torch Adam keeps `step` per parameter, megatron-core's "dp_reshardable" format stores
   it once per param group, and loading then fails with `KeyError: 'step'`: the step is saved in the
   per-rank file and written back;
3. after a load, all parameters share one `step` tensor, so the first update increments it once per
   parameter and the resumed run silently diverges: each parameter gets its own copy.

A test resumes from each (fp32 and distributed) and compares with the uninterrupted run bit for bit.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from miles.backends.megatron.trainer import MegatronTrainer

FORMAT = "miles.megatron_trainer.v1"
INFO = "miles_megatron.json"
_SHARDING = {"distrib_optim_sharding_type": "dp_reshardable"}


def _rank_file(directory: Path) -> Path:
    return directory / f"rank_{dist.get_rank():05d}.pt"


def _inner_optimizers(trainer: MegatronTrainer) -> list:
    opt = trainer.optimizer
    return list(getattr(opt, "chained_optimizers", [opt]))


def _materialise_state(trainer: MegatronTrainer) -> None:
    """Bug 1: give every parameter its (zero) Adam state so that a state dict for loading lists it."""
    for opt in _inner_optimizers(trainer):
        inner = opt.optimizer
        if any(len(inner.state.get(p, {})) == 0 for g in inner.param_groups for p in g["params"]):
            opt.init_state_fn(inner, opt.config)
        for g in inner.param_groups:
            for p in g["params"]:
                # Bug 2: megatron's init_state_fn makes the moments but no `step`, which its
                # distributed state_dict() then looks up.
                inner.state[p].setdefault("step", torch.tensor(0.0))


def _steps(trainer: MegatronTrainer) -> list[list[float]]:
    out = []
    for opt in _inner_optimizers(trainer):
        inner = opt.optimizer
        out.append([float(inner.state[p]["step"]) if "step" in inner.state.get(p, {}) else 0.0
                    for g in inner.param_groups for p in g["params"]])
    return out


def _restore_steps(trainer: MegatronTrainer, steps: list[list[float]]) -> None:
    """Bugs 2 and 3: one `step` tensor per parameter, with the saved value."""
    for opt, values in zip(_inner_optimizers(trainer), steps):
        inner = opt.optimizer
        params = [p for g in inner.param_groups for p in g["params"]]
        for p, v in zip(params, values):
            inner.state[p]["step"] = torch.tensor(v, dtype=torch.float32)


def _sharded(trainer: MegatronTrainer, *, is_loading: bool) -> dict:
    model_sd = trainer.model.module.sharded_state_dict()
    if is_loading:
        _materialise_state(trainer)
    opt_sd = trainer.optimizer.sharded_state_dict(model_sd, is_loading=is_loading, metadata=_SHARDING)
    return {"model": model_sd, "optimizer": opt_sd}


def save(trainer: MegatronTrainer, directory: Path) -> None:
    from megatron.core import dist_checkpointing

    from miles.backends.torch.rng import get_rng_state

    directory.mkdir(parents=True, exist_ok=True)
    _materialise_state(trainer)
    dist_checkpointing.save(_sharded(trainer, is_loading=False), str(directory), content_metadata=_SHARDING)
    torch.save({"format": FORMAT, "num_steps": trainer.num_steps, "rng": get_rng_state(), "adam_steps": _steps(trainer)},
               _rank_file(directory))
    if dist.get_rank() == 0:
        o = trainer.opts
        (directory / INFO).write_text(json.dumps({
            "format": FORMAT, "tensor_model_parallel_size": o.tensor_model_parallel_size,
            "pipeline_model_parallel_size": o.pipeline_model_parallel_size,
            "expert_model_parallel_size": o.expert_model_parallel_size,
            "use_distributed_optimizer": trainer.cfg.train.use_distributed_optimizer,
            "world_size": dist.get_world_size(), "vocab_size": trainer.shape.vocab_size}))
    dist.barrier()


def load(trainer: MegatronTrainer, directory: Path) -> None:
    from megatron.core import dist_checkpointing

    from miles.backends.torch.rng import set_rng_state
    from miles.errors import UserError

    info_path = directory / INFO
    if not info_path.is_file():
        raise UserError(f"{directory} has no {INFO}: it is not a megatron trainer checkpoint (a converted model "
                        "is a starting point, not a resume point).", option="--load")
    info = json.loads(info_path.read_text())
    if info.get("world_size") != dist.get_world_size() or info.get("use_distributed_optimizer") != trainer.cfg.train.use_distributed_optimizer:
        raise UserError(
            f"{directory} was saved by {info.get('world_size')} ranks with --use-distributed-optimizer "
            f"{info.get('use_distributed_optimizer')}; resume it with the same layout.", option="--load")
    state = dist_checkpointing.load(_sharded(trainer, is_loading=True), str(directory))
    with torch.no_grad():  # the distributed optimizer copies into views of the (grad-requiring) parameters
        trainer.model.module.load_state_dict(state["model"], strict=True)
        trainer.optimizer.load_state_dict(state["optimizer"])
    mine = torch.load(_rank_file(directory), weights_only=True)
    if mine.get("format") != FORMAT:
        raise ValueError(f"{_rank_file(directory)} is not a {FORMAT} file")
    _restore_steps(trainer, mine["adam_steps"])
    trainer.num_steps = int(mine["num_steps"])
    set_rng_state(mine["rng"])
    dist.barrier()
