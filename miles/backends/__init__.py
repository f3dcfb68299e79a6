"""Training backends: they own the model being trained, its optimizer and its state dicts.

- `miles.backends.base`: the trainer interface (`TrainerBackend`) and the packed batch (`PackedBatch`)
  that every backend implements and consumes; `miles.backends.packing.pack_samples` builds batches.
- `miles.backends.torch`: plain PyTorch (CPU or GPU), data parallel with torch DDP over gloo/NCCL;
  the embedded default.

A backend computes response log-probs, runs train steps with the loss from `miles.algo`, and hands out
weights in Hugging Face naming for the rollout engines. It never imports a rollout engine. Nothing heavy
is imported here; import the backend's own package to get its trainer.
"""
