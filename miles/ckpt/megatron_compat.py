"""Run megatron-core 0.16.1 on a machine without CUDA: the one place where we patch it.

What it is: a handful of narrow, reversible monkey-patches that let megatron-core build a `GPTModel`
with the local (non-TransformerEngine) layer spec, run it forward on CPU and save/load `torch_dist`
checkpoints. Every patch below says which megatron-core call needs it and why; all of them are pinned
to megatron-core 0.16.1 (`SUPPORTED_VERSION`) and refuse to apply to any other version, because each
one reaches into a private detail that a new release may move.

What it is not: a CPU port of megatron-core. Only the calls exercised by the converter, its tests and
the embedded training path are covered; TransformerEngine, fused kernels and CUDA graphs stay off.
On a machine with CUDA the patches are not applied at all.

Use:

    from miles.ckpt.megatron_compat import cpu_compat, ensure_cpu_compat

    with cpu_compat():              # patches in, restored on exit (tests, one-off conversions)
        model = GPTModel(...)

    ensure_cpu_compat()             # idempotent, process-wide (a worker process that stays on CPU)

    with quiet_megatron_import():   # no "Transformer Engine and Apex are not installed" warnings
        from megatron.core import dist_checkpointing
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import warnings
from typing import Any, Callable, Iterator

SUPPORTED_VERSION = "0.16.1"

# (module path, attribute) -> original value, for the patches currently applied.
_ORIGINALS: dict[tuple[str, str], Any] = {}
_RNG_WAS_PATCHED = False


# Warnings megatron-core 0.16.1 emits on import when TransformerEngine/Apex are absent (always the
# case on CPU): expected, and nothing a user can act on.
_EXPECTED_IMPORT_WARNINGS = r"Transformer Engine and Apex are not installed"


@contextlib.contextmanager
def quiet_megatron_import() -> Iterator[None]:
    """Import megatron-core modules inside this block without its expected no-TE/no-Apex warnings."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_EXPECTED_IMPORT_WARNINGS, category=UserWarning)
        yield


def megatron_version() -> str:
    """The installed megatron-core version, or raise if it is missing."""
    try:
        with quiet_megatron_import():
            from megatron.core import __version__  # megatron-core is light to import (no CUDA init)
    except ImportError as e:  # pragma: no cover - the package is a hard dependency
        raise RuntimeError("megatron-core is not installed; install miles with its dependencies") from e
    return __version__


def check_version() -> None:
    """Refuse a megatron-core whose private details the patches were not written against."""
    found = megatron_version()
    if found != SUPPORTED_VERSION:
        raise RuntimeError(
            f"miles.ckpt.megatron_compat is pinned to megatron-core {SUPPORTED_VERSION} but "
            f"{found} is installed; re-check every patch in this module against {found} before "
            "raising SUPPORTED_VERSION"
        )
    # A torch_dist save without psutil does not fail: megatron's async writer waits forever for a
    # worker that died on the import (megatron-core does not declare the dependency).
    if importlib.util.find_spec("psutil") is None:
        raise RuntimeError("megatron-core torch_dist saves hang without psutil; pip install psutil")


def _cpu_current_device() -> str:
    # megatron-core uses torch.cuda.current_device() as a `device=` argument (rotary embedding,
    # linear layers with use_cpu_initialization=False, attention buffers); "cpu" is accepted there.
    return "cpu"


def _cpu_default_causal_mask(sq: int):
    import torch

    # megatron.core.transformer.utils.get_default_causal_mask hard-codes device="cuda"; the fused
    # softmax (used by the local DotProductAttention) calls it whenever no mask is passed.
    return torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)


def _cpu_sliding_window_mask(sq: int, skv: int, window_size):
    import torch

    # Same hard-coded device="cuda" as above, for sliding-window attention.
    m = torch.ones(sq, skv, dtype=torch.bool)
    mu = torch.triu(m, diagonal=skv - sq - window_size[0])
    return ~torch.tril(mu, diagonal=skv - sq + window_size[1])


def _noop(*_args: Any, **_kwargs: Any) -> None:
    return None


# Training (miles/backends/megatron) reaches megatron-core code that creates small bookkeeping tensors
# with a literal device='cuda' (loss-scale and found-inf flags in the optimizer, norms in grad
# clipping, token counters in the pipeline schedules, shape exchange in p2p communication). Those
# modules get a `torch` that maps that device to the CPU; everything else is the real torch.
_FACTORIES = ("tensor", "zeros", "ones", "empty", "full", "zeros_like", "ones_like", "empty_like")
_MODULES_WITH_CUDA_LITERALS = (
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.optimizer.distrib_optimizer",
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.pipeline_parallel.p2p_communication",
    "megatron.core.distributed.param_and_grad_buffer",
    "megatron.core.distributed.finalize_model_grads",
    "megatron.core.utils",  # the local multi_tensor_l2_norm / scale fallbacks
)


class _TorchOnCpu:
    """The `torch` module as seen by one megatron-core module: device='cuda' factories make CPU tensors."""

    def __init__(self, real: Any):
        self._real = real

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._real, name)
        if name not in _FACTORIES:
            return value

        def factory(*args: Any, **kwargs: Any) -> Any:
            if str(kwargs.get("device", "")).startswith("cuda"):
                kwargs["device"] = "cpu"
            return value(*args, **kwargs)

        return factory


def _with_cuda_type_names(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Run `fn` while `Tensor.type()` names CPU tensors as their CUDA twins: megatron-core's fp32
    optimizer paths assert `param.type() == 'torch.cuda.FloatTensor'` to pick the fp32 branch."""
    import functools

    import torch

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        real = torch.Tensor.type

        def cuda_named(self, dtype=None, non_blocking=False, **kw):  # noqa: ANN001
            if dtype is None and not kw and not self.is_cuda:
                return real(self).replace("torch.", "torch.cuda.", 1)
            return real(self, dtype, non_blocking, **kw)

        torch.Tensor.type = cuda_named
        try:
            return fn(*args, **kwargs)
        finally:
            torch.Tensor.type = real

    return wrapper


def _patches() -> list[tuple[str, str, Callable[..., Any]]]:
    return [
        ("torch.cuda", "current_device", _cpu_current_device),
        # filesystem_async.py stages tensors with non_blocking copies then calls
        # torch.cuda.synchronize(), which raises "Torch not compiled with CUDA" on a CPU build.
        ("torch.cuda", "synchronize", _noop),
        ("megatron.core.fusions.fused_softmax", "get_default_causal_mask", _cpu_default_causal_mask),
        ("megatron.core.fusions.fused_softmax", "get_sliding_window_causal_mask", _cpu_sliding_window_mask),
        ("megatron.core.transformer.utils", "get_default_causal_mask", _cpu_default_causal_mask),
    ]


def _with_cuda_as_cpu(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Run `fn` while `Tensor.cuda()` returns the tensor itself: a tied model split over pipeline
    stages moves the output layer's copy of the embedding with `.data.cuda()` before all-reducing it."""
    import functools

    import torch

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        real = torch.Tensor.cuda
        torch.Tensor.cuda = lambda self, *a, **k: self
        try:
            return fn(*args, **kwargs)
        finally:
            torch.Tensor.cuda = real

    return wrapper


def _training_patches() -> list[tuple[str, str, Any]]:
    import torch

    out: list[tuple[str, str, Any]] = [(m, "torch", _TorchOnCpu(torch)) for m in _MODULES_WITH_CUDA_LITERALS]
    clip = importlib.import_module("megatron.core.optimizer.clip_grads").clip_grad_by_total_norm_fp32
    out.append(("megatron.core.optimizer.optimizer", "clip_grad_by_total_norm_fp32", _with_cuda_type_names(clip)))
    dist_opt = importlib.import_module("megatron.core.optimizer.distrib_optimizer").DistributedOptimizer
    build = dist_opt.__dict__["_build_model_and_main_param_groups"]
    out.append(("megatron.core.optimizer.distrib_optimizer.DistributedOptimizer", "_build_model_and_main_param_groups",
                type(build)(_with_cuda_type_names(build.__func__))))  # keep it a classmethod/staticmethod
    # --bf16 without the distributed optimizer: the same param.type() test picks which parameters get
    # fp32 main copies.
    f16 = importlib.import_module("megatron.core.optimizer.optimizer").Float16OptimizerWithFloat16Params
    out.append(("megatron.core.optimizer.optimizer.Float16OptimizerWithFloat16Params", "__init__",
                _with_cuda_type_names(f16.__dict__["__init__"])))
    # Activation recompute (--recompute-granularity) saves and restores "the CUDA generator" around
    # every checkpointed block (tensor_parallel.random.CheckpointFunction). A CPU build has none: the
    # CPU generator, which megatron saves and restores next to it, is the only one that draws.
    out.append(("megatron.core.tensor_parallel.random", "_get_cuda_rng_state", _noop))
    out.append(("megatron.core.tensor_parallel.random", "_set_cuda_rng_state", _noop))
    lm = importlib.import_module("megatron.core.models.common.language_module.language_module").LanguageModule
    out.append(("megatron.core.models.common.language_module.language_module.LanguageModule",
                "setup_embeddings_and_output_layer", _with_cuda_as_cpu(lm.__dict__["setup_embeddings_and_output_layer"])))
    return out


def _target(path: str) -> Any:
    """A module, or a class inside one ("pkg.module.Class")."""
    try:
        return importlib.import_module(path)
    except ModuleNotFoundError:
        module_name, _, cls = path.rpartition(".")
        return getattr(importlib.import_module(module_name), cls)


def _apply() -> None:
    global _RNG_WAS_PATCHED
    for module_name, attr, replacement in _patches() + _training_patches():
        module = _target(module_name)
        key = (module_name, attr)
        if key not in _ORIGINALS:
            # __dict__ first: a staticmethod must be restored as the staticmethod object itself.
            _ORIGINALS[key] = module.__dict__[attr] if attr in module.__dict__ else getattr(module, attr)
            setattr(module, attr, replacement)
    # The model-parallel RNG tracker forks the *CUDA* generator around every attention dropout and
    # embedding dropout (entered on each forward even with dropout 0). megatron-core's own inference
    # tracker makes fork() a no-op; CPU dropout then uses the CPU generator, seeded by the caller.
    from megatron.core.tensor_parallel import random as mp_random

    if not _RNG_WAS_PATCHED:
        mp_random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
        _RNG_WAS_PATCHED = True


def _restore() -> None:
    global _RNG_WAS_PATCHED
    for (module_name, attr), original in list(_ORIGINALS.items()):
        setattr(_target(module_name), attr, original)
        del _ORIGINALS[(module_name, attr)]
    if _RNG_WAS_PATCHED:
        from megatron.core.tensor_parallel import random as mp_random

        mp_random.initialize_rng_tracker(force_reset=True)
        _RNG_WAS_PATCHED = False


def needs_cpu_compat() -> bool:
    """True on a machine without CUDA, where megatron-core needs the patches."""
    import torch

    return not torch.cuda.is_available()


def ensure_cpu_compat() -> None:
    """Apply the CPU patches for the rest of the process (idempotent; nothing happens with CUDA)."""
    check_version()
    if needs_cpu_compat():
        _apply()


@contextlib.contextmanager
def cpu_compat() -> Iterator[None]:
    """Apply the CPU patches inside the block and restore megatron-core/torch afterwards.

    Patches that were already in place when the block was entered (from `ensure_cpu_compat`) stay.
    """
    check_version()
    if not needs_cpu_compat() or _ORIGINALS:
        yield
        return
    _apply()
    try:
        yield
    finally:
        _restore()


def ensure_moe_router_without_te() -> None:
    """megatron-core 0.16.1's MoE router (`moe_utils.router_gating_linear`) tests `te_general_gemm is not
    None`, a name `moe_utils` defines only when TransformerEngine imports; without TE (every CPU, and a
    GPU with --transformer-impl local and no TE installed) the first MoE forward raises NameError. The
    name set to None makes it take its own torch.mm path, as the check intends. Idempotent; nothing
    happens when TE defined it."""
    check_version()
    with quiet_megatron_import():
        from megatron.core.transformer.moe import moe_utils
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def _alltoall_dtoh_on_cpu(self, point: str, tokens_per_expert=None):
    # The CPU body of MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize: the routing counts are
    # host tensors already, so no copy stream and no event; the splits become numpy arrays at the same
    # point, as the CUDA body leaves them (all_to_all_single takes them as split sizes).
    if not self.drop_and_pad and point == self.cuda_dtoh_point:
        for name in ("input_splits", "output_splits", "output_splits_tp"):
            value = getattr(self, name)
            if value is not None and hasattr(value, "numpy"):
                setattr(self, name, value.numpy())
    return tokens_per_expert


def ensure_alltoall_dispatcher_without_cuda() -> None:
    """megatron-core 0.16.1's all-to-all MoE token dispatcher (the one that takes a different token count
    on each expert-parallel rank; the all-gather dispatcher needs the same count everywhere) creates a
    `torch.cuda.Stream` in its constructor and copies its routing counts device-to-host on it. On a
    machine without CUDA the stream is replaced by a placeholder (never used) and the copy by
    `_alltoall_dtoh_on_cpu`. Idempotent; nothing happens with CUDA."""
    check_version()
    if not needs_cpu_compat():
        return
    with quiet_megatron_import():
        from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher
    if MoEAlltoAllTokenDispatcher.cuda_dtoh_stream is None:
        MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = "no CUDA: host copies (miles.ckpt.megatron_compat)"
    MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize = _alltoall_dtoh_on_cpu
