"""The pure algorithm layer: tensors in, tensors out; no I/O, no Ray, no models.

- `miles.algo.kl`: KL estimators k1, k2, k3, low_var_kl (`approx_kl`).
- `miles.algo.entropy`: per-position entropy of logits (`entropy_from_logits`).
- `miles.algo.reduce`: masked means and the loss reduction shared by every loss.
- `miles.algo.advantages`: group reward normalisation and the advantage estimators
  (grpo, gspo, reinforce_plus_plus, reinforce_plus_plus_baseline, ppo GAE), advantage whitening.
- `miles.algo.losses`: policy (PPO/GSPO surrogate + entropy + KL loss + rollout correction), SFT and
  value losses, `get_loss_function`.
- `miles.algo.rollout_correction`: vanilla TIS and the MIS function (`--custom-config-path` YAML).

Every function takes python lists of 1-D tensors, one per sample over its response tokens, with 0/1
float loss masks of the same length. The formulas as implemented are in docs/algorithms.md; the
tests in tests/algo compare each one with numbers worked out by hand.

This package imports nothing at package import time, so `miles.config` may read `MisConfig` without
pulling torch; import the submodules you need.
"""
