"""The megatron-core training backend: `MegatronTrainer` (TP/PP/CP/EP, megatron DDP and optimizer).

Use: `from miles.backends.megatron import MegatronTrainer` inside a training worker process (importing
the package itself is cheap: `MegatronTrainer` is loaded on first access, and megatron-core only when a
trainer is built). Modules: `model` (GPTModel
from the HF config, weights in and out through convert's rule tables), `forward` (packed batches with a
block-diagonal mask), `parallel` (option checks, process groups), `trainer`, `checkpoint` (torch_dist
save/load with the distributed-optimizer workarounds). See docs/training.md.
"""


def __getattr__(name: str):
    if name == "MegatronTrainer":
        from miles.backends.megatron.trainer import MegatronTrainer

        return MegatronTrainer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
