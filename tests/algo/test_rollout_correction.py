"""MIS rollout correction (tis_mode, tis_level, rejection sampling, veto, batch normalisation) and its
use through --custom-tis-function-path + --custom-config-path, against hand-computed numbers."""

from __future__ import annotations

import math

import pytest
import torch

from algo_hand_checks import T, call_packed, close, make_cfg, packed
from miles.algo.losses import policy_loss as _policy_loss
from miles.algo.rollout_correction import mis_function
from miles.config.algo import MIS_FUNCTION_PATH, MisConfig

OLD = T([-1.0, -1.0, -1.0])
ROLLOUT = OLD - T([3.0, 1.0, 0.25]).log()  # rho = exp(old - rollout) = [3, 1, 0.25]
MASK = T([1.0, 1.0, 1.0])
PG = T([-1.0, -1.0, -1.0])


def run(mis: MisConfig, *, pg=(PG,), train=(OLD,), rollout=(ROLLOUT,), masks=(MASK,)):
    """mis_function on the packed samples; outputs split back per sample (lists) for the checks."""
    mask, seg = packed(masks)
    out, new_mask, metrics = mis_function(
        make_cfg(), pg_loss=packed(pg)[0], train_log_probs=packed(train)[0], rollout_log_probs=packed(rollout)[0],
        loss_mask=mask, segments=seg, mis=mis,
    )
    return seg.split(out), seg.split(new_mask), {k: seg.split(v) for k, v in metrics.items()}


def test_truncate_token_level():
    out, masks, m = run(MisConfig(tis_mode="truncate", tis_upper_bound=2.0))
    close(out[0], [-2.0, -1.0, -0.25])  # min(rho, 2)
    close(masks[0], [1.0, 1.0, 1.0])
    close(m["mis_tis_truncate_fraction"][0], [1.0, 0.0, 0.0])
    close(m["mis_tis_weight_before_bound"][0], [3.0, 1.0, 0.25])
    assert all(k.startswith("mis_") for k in m)


def test_clip_token_level_with_lower_bound():
    out, _, m = run(MisConfig(tis_mode="clip", tis_lower_bound=0.5, tis_upper_bound=2.0))
    close(out[0], [-2.0, -1.0, -0.5])
    close(m["mis_tis_clip_fraction_low"][0], [0.0, 0.0, 1.0])
    close(m["mis_tis_clip_fraction_high"][0], [1.0, 0.0, 0.0])


def test_clip_default_lower_bound_is_inverse_upper():
    out, _, _ = run(MisConfig(tis_mode="clip", tis_upper_bound=2.0))  # lower = 1/2
    close(out[0], [-2.0, -1.0, -0.5])


def test_mask_mode_removes_out_of_band_tokens():
    out, masks, m = run(MisConfig(tis_mode="mask", tis_lower_bound=0.5, tis_upper_bound=2.0))
    close(masks[0], [0.0, 1.0, 0.0])
    close(out[0], [-3.0, -1.0, -0.25])  # weights are not bounded in mask mode
    close(m["mis_tis_mask_fraction_low"][0], [0.0, 0.0, 1.0])


def test_sequence_and_geometric_levels():
    # log-ratios [ln 3, 0, ln 0.25]: sum ln 0.75 -> 0.75 per token; mean -> 0.75^(1/3) = 0.9085603
    out, _, _ = run(MisConfig(tis_level="sequence", tis_upper_bound=2.0))
    close(out[0], [-0.75] * 3)
    out, _, _ = run(MisConfig(tis_level="geometric", tis_upper_bound=2.0))
    close(out[0], [-0.9085602964] * 3)


def test_sequence_level_ignores_masked_tokens():
    out, _, _ = run(MisConfig(tis_level="sequence", tis_upper_bound=10.0), masks=(T([1.0, 1.0, 0.0]),))
    close(out[0], [-3.0, -3.0, 0.0])  # product over trained tokens = 3 * 1; masked token weight 0


def test_rejection_sampling_and_veto():
    mis = MisConfig(tis_upper_bound=10.0, use_rs=True, rs_lower_bound=0.5, rs_upper_bound=2.0)
    out, masks, m = run(mis)
    close(masks[0], [0.0, 1.0, 0.0])
    close(m["mis_rs_mask_fraction_low"][0], [0.0, 0.0, 1.0])
    close(m["mis_rs_mask_fraction_high"][0], [1.0, 0.0, 0.0])
    # veto: one token ratio 0.25 < 0.3 rejects the whole sample
    mis = MisConfig(tis_upper_bound=10.0, use_rs=True, rs_lower_bound=0.1, rs_upper_bound=10.0, rs_veto_threshold=0.3)
    _, masks, m = run(mis)
    close(masks[0], [0.0, 0.0, 0.0])
    close(m["mis_rs_catastrophic_seq_fraction"][0], [1.0, 1.0, 1.0])


def test_batch_normalize_token_level():
    mis = MisConfig(tis_mode="truncate", tis_upper_bound=2.0, tis_batch_normalize=True)
    train = (T([-1.0, -1.0]), T([-1.0]))
    rollout = (train[0] - T([3.0, 1.0]).log(), train[1] - T([0.5]).log())
    out, _, m = run(mis, pg=(T([-1.0, -1.0]), T([-1.0])), train=train, rollout=rollout, masks=(T([1.0, 1.0]), T([1.0])))
    # truncated weights [2, 1] and [0.5]: token mean 3.5 / 3 = 7/6 -> [12/7, 6/7], [3/7]
    close(out[0], [-12 / 7, -6 / 7])
    close(out[1], [-3 / 7])
    close(m["mis_is_ratio_mean_final"][0], [9 / 7, 9 / 7])
    close(m["mis_is_ratio_max_final"][0], [12 / 7, 12 / 7])


def test_mismatch_metrics_only_when_tis_and_rs_off():
    out, masks, m = run(MisConfig(use_tis=False))
    close(out[0], PG)
    # kl = rollout - train = [-ln 3, 0, ln 4]; k3 = rho - 1 - ln rho
    close(m["mis_kl"][0], [-math.log(3), 0.0, math.log(4)])
    close(m["mis_k3_kl"][0], [2 - math.log(3), 0.0, -0.75 + math.log(4)])
    close(m["mis_training_ppl"][0], [math.e] * 3)


def test_policy_loss_with_mis_yaml_keeps_original_denominators(tmp_path):
    yaml_path = tmp_path / "mis.yaml"
    yaml_path.write_text("use_tis: true\ntis_mode: mask\ntis_lower_bound: 0.5\ntis_upper_bound: 2.0\n")
    cfg = make_cfg(use_tis=True, custom_tis_function_path=MIS_FUNCTION_PATH, custom_config_path=str(yaml_path))
    cfg.check(n_samples_per_prompt=1)
    loss, m = call_packed(
        _policy_loss, cfg, log_probs=[OLD.clone().requires_grad_()], old_log_probs=[OLD], advantages=[T([1.0] * 3)],
        loss_masks=[MASK], rollout_log_probs=[ROLLOUT],
    )
    # only the middle token (rho 1) survives: -1 * 1 summed, divided by the ORIGINAL 3 tokens
    close(loss, -1 / 3)
    # metrics are reduced with the original mask: 1 of 3 tokens below the band
    close(m["mis_tis_mask_fraction_low"], 1 / 3)
    assert "tis" not in m and "mis_is_ratio_mean_final" in m


def test_bad_mis_yaml_is_a_user_error(tmp_path):
    from miles.errors import UserError

    bad = tmp_path / "bad.yaml"
    bad.write_text("tis_mode: truncat\n")
    cfg = make_cfg(use_tis=True, custom_tis_function_path=MIS_FUNCTION_PATH, custom_config_path=str(bad))
    with pytest.raises(UserError, match="tis_mode"):
        cfg.check(1)
    bad.write_text("rs_veto_threshold: 1e-4\n")  # YAML reads this as a string
    with pytest.raises(UserError, match="1.0e-4"):
        cfg.check(1)
    bad.write_text("tis_levle: token\n")
    with pytest.raises(UserError, match="unknown MIS key"):
        cfg.check(1)
