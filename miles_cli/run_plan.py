"""What a run needs before it starts, shared by `--dry-run` (printed) and `train`/`full-train` (enforced):
the memory plan of one GPU against `--hardware` (miles/config/memory_plan.py) and the settings no
trainer runs yet (miles/config/trainer_support.py).

The model's numbers come from `<--hf-checkpoint>/config.json` when it is on disk, else from the recipe's
own copy (`SPEC.hf_config` of the real-model recipes); with neither (a model `full-train` will create),
there is no memory plan yet and the dry run says so.
"""

from __future__ import annotations

from typing import Any

from miles.errors import UserError


def model_config(inv) -> dict[str, Any] | None:
    from miles.config.model_size import read_config

    path = inv.config.rollout.hf_checkpoint
    found = read_config(path) if path else None
    if found is not None:
        return found
    spec = getattr(inv.recipe, "SPEC", None)
    return getattr(spec, "hf_config", None)


def hardware(inv) -> str | None:
    return getattr(inv.options, "hardware", None)


def on_gpu(inv) -> bool:
    from miles.config.memory_plan import HARDWARE_MEMORY

    return hardware(inv) in HARDWARE_MEMORY or inv.config.cluster.device == "cuda"


def memory_plan(inv):
    """(MemoryPlan, None), or (None, why there is none): no config.json yet, or one the count cannot read."""
    from miles.config.memory_plan import plan_memory
    from miles.config.model_size import ModelSize

    config = model_config(inv)
    where = f"{inv.config.rollout.hf_checkpoint}/config.json"
    if config is None:
        return None, f"{where} does not exist (full-train's prepare steps create it; rerun --dry-run after them)"
    try:
        size = ModelSize.from_hf_config(config)
    except (KeyError, TypeError, ValueError) as e:  # a config.json of another shape: no plan, not a crash
        return None, f"{where} has no {e} the parameter count needs"
    return plan_memory(inv.config, size, hardware(inv), teacher=_teacher_size(inv)), None


def _teacher_size(inv):
    """The --opd-type megatron teacher's size from `<--opd-teacher-load>/config.json` (None: not readable)."""
    from miles.config.model_size import ModelSize, read_config

    o = inv.config.opd
    if not (o.use_opd and o.opd_type == "megatron" and o.opd_teacher_load):
        return None
    config = read_config(o.opd_teacher_load)
    try:
        return ModelSize.from_hf_config(config) if config is not None else None
    except (KeyError, TypeError, ValueError):
        return None


def trainer_gaps(inv) -> list[tuple[str, str]]:
    from miles.ckpt.convert.families import ARCHITECTURES
    from miles.config.trainer_support import gaps

    config = model_config(inv) or {}
    arch = (config.get("architectures") or [None])[0]
    return gaps(inv.config, gpu=on_gpu(inv), architecture=arch, families=ARCHITECTURES)


def check_memory(inv, plan=None) -> None:
    """Exit 2 with the arithmetic and the options that would fit, when the plan does not fit."""
    plan = plan if plan is not None else memory_plan(inv)[0]
    if plan is None or plan.fits:
        return
    raise UserError(
        f"the memory plan does not fit {plan.hardware} ({plan.layout}): " + "; ".join(plan.problems)
        + ". Options that would fit: " + "; ".join(plan.fixes) + ".",
        option="--hardware",
    )


def check_can_train(inv) -> None:
    """`train`/`full-train`: refuse what no trainer runs yet, then a plan that cannot fit."""
    from miles.ckpt.convert.families import ARCHITECTURES
    from miles.config.trainer_support import check

    config = model_config(inv) or {}
    check(inv.config, gpu=on_gpu(inv), architecture=(config.get("architectures") or [None])[0], families=ARCHITECTURES)
    check_memory(inv)
