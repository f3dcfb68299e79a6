"""The torch training backend: a Hugging Face causal LM trained with AdamW, optionally data parallel.

Use: `from miles.backends.torch import TorchTrainer` (in-process or inside a Ray actor). See
`miles/backends/torch/trainer.py` for the train step and `docs/training.md` for the whole picture.
"""

from miles.backends.torch.trainer import TorchTrainer

__all__ = ["TorchTrainer"]
