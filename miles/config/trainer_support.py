"""What the trainers cannot run yet, in one place: each entry is a setting a plan may name and
`train`/`full-train` refuse (exit 2, one sentence) until a trainer implements it.

An option's declaration stays honest about what it would do; this table says which values of it
no trainer runs today, why (the code that is missing), and what lifts the refusal. `--dry-run`
prints the plan anyway, with a "Cannot train yet" line, so a recipe can describe the run it is meant
for (upstream's layout) without pretending it starts. Help texts append `not_yet(option)`, so help and
docs say the same. When a trainer implements a setting, delete its entry here (and nothing else).

Pure data and small functions: no torch, so `miles --help` can read it.
"""

from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Collection
from typing import Any, Callable

from miles.errors import UserError

_TE_PACKING = (
    "packed micro-batches reach TransformerEngine with PackedSeqParams (thd), which no GPU run has checked yet "
    "(its causal mask ignores the block-diagonal mask, so without them packed samples attend to each other)"
)
_TE_LIFT = ("tests/backends/megatron/test_megatron_gpu.py::test_transformer_engine_packed_samples_attend_only_to_themselves "
            "passing on a GPU (scripts/gpu_smoke.sh)")


@dataclass(frozen=True)
class Gap:
    option: str  # engine field name
    refused: Callable[[Any], bool]  # value -> True when this value cannot run
    backends: tuple[str, ...]  # --train-backend values the gap applies to
    reason: str  # why it cannot run today (the missing code), a clause
    lift: str  # what a trainer must implement to delete this entry
    setting: str = ""  # how the refused value reads, e.g. "> 1" (empty: the flag itself)


ALL = ("torch", "fsdp", "megatron")

GAPS: tuple[Gap, ...] = (
    Gap("context_parallel_size", lambda v: v > 1, ("megatron",),
        "the megatron forward does not split the packed sequences over context-parallel ranks",
        "CP sharding of the packed stream with PackedSeqParams (TransformerEngine attention) and CP-aware log-probs",
        "> 1"),
    Gap("expert_tensor_parallel_size", lambda v: v > 1, ("megatron",),
        "no test has trained with each expert's weights split over tensor-parallel ranks or synced them to an engine",
        "a megatron test where --expert-tensor-parallel-size 2 trains like 1 and its weight buckets are the HF tensors", "> 1"),
    Gap("optimizer_cpu_offload", bool, ("megatron",),
        "the megatron backend builds megatron-core's optimizer without CPU offload",
        "OptimizerConfig(optimizer_cpu_offload=True, use_precision_aware_optimizer=True) with bf16"),
    Gap("transformer_impl", lambda v: v == "transformer_engine", ("megatron",), _TE_PACKING, _TE_LIFT, "transformer_engine"),
    Gap("attention_backend", lambda v: v in ("flash", "fused"), ("megatron",), _TE_PACKING, _TE_LIFT, "flash/fused"),
    Gap("fp8_format", lambda v: v is not None, ("megatron",), "FP8 needs TransformerEngine, and " + _TE_PACKING,
        "TransformerEngine packing (above) checked on a GPU, with bf16 master weights", "set"),
)

GPU_GAPS: dict[str, tuple[str, str]] = {}
"""--train-backend value -> (reason, lift) for a trainer that cannot run on GPUs at all (refused when the
run trains on GPUs: megatron always, torch/fsdp with more than one worker). Empty: both trainers put
their models on the device and make every collective's tensor on its group's device
(miles/backends/collectives.py); what that leaves unverified without a GPU is listed in
scripts/gpu_smoke.sh, whose GPU-only tests check it."""


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def not_yet(option: str) -> str:
    """The sentence an option's help appends while some of its values cannot run (empty when none)."""
    gap = next((g for g in GAPS if g.option == option), None)
    if gap is None:
        return ""
    which = f"{_flag(option)} {gap.setting}".strip()
    backends = "any trainer" if gap.backends == ALL else "--train-backend " + "/".join(gap.backends)
    return f" Not run by {backends} yet ({which}: {gap.reason}); train refuses it, --dry-run plans it."


def gaps(
    cfg, *, gpu: bool, architecture: str | None = None, families: Collection[str] = ()
) -> list[tuple[str, str]]:
    """(flag, sentence) for every setting of `cfg` that no trainer runs yet; `gpu`: the run trains on GPUs;
    `architecture`: the model's HF architecture when known, checked against `families` (the architectures
    miles trains; the caller reads them from miles.ckpt.convert.families, which imports config)."""
    backend = cfg.train.train_backend
    out = []
    if architecture is not None and architecture not in families:
        supported = ", ".join(sorted(families))
        out.append(("--hf-checkpoint", f"miles has no {architecture} family in convert or the trainers (supported: {supported})"))
    by_reason: dict[str, list[str]] = {}  # settings refused for one reason share one sentence
    for g in GAPS:
        value = cfg.get(g.option)
        if backend in g.backends and g.refused(value):
            by_reason.setdefault(g.reason, []).append(_flag(g.option) + ("" if isinstance(value, bool) else f" {value}"))
    out += [(settings[0].split()[0], f"{', '.join(settings)} — {reason}") for reason, settings in by_reason.items()]
    world = cfg.cluster.actor_num_nodes * cfg.cluster.actor_num_gpus_per_node
    if gpu and backend in GPU_GAPS and (backend == "megatron" or world > 1):
        out.append(("--train-backend", f"--train-backend {backend} on GPUs — {GPU_GAPS[backend][0]}"))
    return out


def check(cfg, *, gpu: bool, architecture: str | None = None, families: Collection[str] = ()) -> None:
    """Raise one UserError naming everything this run needs that no trainer runs yet."""
    found = gaps(cfg, gpu=gpu, architecture=architecture, families=families)
    if found:
        raise UserError(
            "cannot train yet: " + "; ".join(s for _, s in found) + " (--dry-run shows the whole plan).",
            option=found[0][0],
        )
