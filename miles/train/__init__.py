"""The RL step, written once for every training backend.

- `step.train_rollout(backend, train_data, rollout_id=...)`: one rollout's optimizer steps on one rank;
- `batching`: a rollout cut into optimizer steps, data-parallel shards and micro-batches;
- `packing.pack_samples`: per-sample train data to a `PackedBatch`;
- `inputs.fill_policy_inputs`: old/ref log-probs, critic values, advantages and returns;
- `loss.packed_loss`: the loss from `miles.algo` on a packed batch;
- `lr_schedule.lr_at`: the learning rate of an optimizer step;
- `metrics`: how metrics fold over micro-batches, ranks and steps.

It talks to a trainer only through `miles.backends.base.TrainerBackend` and never asks which backend
it got. Nothing heavy is imported here.
"""
