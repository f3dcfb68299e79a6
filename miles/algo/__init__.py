"""The pure algorithm layer: tensors in, tensors out; no I/O, no Ray, no models.

- `miles.algo.kl`: KL estimators k1, k2, k3, low_var_kl (`approx_kl`).
- `miles.algo.entropy`: per-position entropy of logits (`entropy_from_logits`).
- `miles.algo.segments`: `Segments` (per-sample sums, max, broadcast over packed tokens).
- `miles.algo.reduce`: masked means and the loss reduction shared by every loss.
- `miles.algo.advantages`: group reward normalisation and the advantage estimators
  (grpo, gspo, reinforce_plus_plus, reinforce_plus_plus_baseline, ppo GAE), advantage whitening.
- `miles.algo.losses`: policy (PPO/GSPO surrogate + entropy + KL loss + rollout correction), SFT and
  value losses, `get_loss_function`.
- `miles.algo.rollout_correction`: vanilla TIS and the MIS function (`--custom-config-path` YAML).

Every function works on packed tensors: one flat [R] tensor over the response tokens of a batch of
samples, a 0/1 float [R] loss mask, and a `miles.algo.segments.Segments` that says which tokens
belong to which sample; per-sample steps are segment reductions, never a Python loop over samples. The formulas as implemented are in docs/algorithms.md; the
tests in tests/algo compare each one with numbers worked out by hand.

This package imports nothing at package import time, so `miles.config` may read `MisConfig` without
pulling torch; import the submodules you need.
"""
