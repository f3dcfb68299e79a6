"""The torch training backend: a Hugging Face causal LM trained with AdamW, data parallel with torch DDP.

Use: `from miles.backends.torch import TorchBackend` (in-process or inside a Ray actor); it implements
`miles.backends.base.TrainerBackend`. See `miles/backends/torch/trainer.py` for the train step,
`checkpoint.py` for the per-rank checkpoints and `docs/training.md` for the whole picture.
"""

from miles.backends.torch.trainer import TorchBackend

__all__ = ["TorchBackend"]
