"""Training backends: they own the model being trained, its optimizer and its state dicts.

- `miles.backends.base`: the trainer interface (`TrainerBackend`: compute primitives) and the packed
  batch (`PackedBatch`) that every backend implements and consumes; `miles.train.packing.pack_samples`
  builds batches and `miles.train.step.train_rollout` drives a backend through one rollout.
- `miles.backends.torch`: plain PyTorch (CPU or GPU), data parallel with torch DDP over gloo/NCCL;
  the embedded default.

A backend computes response log-probs, runs forward-backward with the loss it is given and optimizer
steps at the lr it is given, and hands out weights in Hugging Face naming for the rollout engines. It
holds no RL logic (that is `miles/train/`) and never imports a rollout engine. Nothing heavy
is imported here; import the backend's own package to get its trainer.
"""
