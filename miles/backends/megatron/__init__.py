"""The megatron-core training backend: `MegatronTrainer` (TP/PP/CP/EP, megatron DDP and optimizer).

Use: `from miles.backends.megatron.trainer import MegatronTrainer` inside a training worker process
(importing this package itself is cheap: it does not import megatron-core). Modules: `model` (GPTModel
from the HF config, weights in and out through convert's rule tables), `forward` (packed batches with a
block-diagonal mask), `parallel` (option checks, process groups), `trainer`, `checkpoint` (torch_dist
save/load with the distributed-optimizer workarounds). See docs/training.md.
"""
