"""docs/algorithms.md stays true: it names only AlgoConfig flags, all of them, and every metric the losses emit."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from algo_hand_checks import T, call_packed, make_cfg
from miles.algo.losses import policy_loss, value_loss
from miles.algo.rollout_correction import mis_function
from miles.config.algo import AlgoConfig, MisConfig
from miles.config.fields import flag_name

PAGE = (Path(__file__).resolve().parents[2] / "docs" / "algorithms.md").read_text()


def test_page_mentions_exactly_the_algo_flags():
    from miles.config.critic import CriticConfig
    from miles.config.opd import OpdConfig

    # The page documents the objective, PPO's critic and on-policy distillation (their own option groups).
    flags = {flag_name(f) for f in (*dataclasses.fields(AlgoConfig), *dataclasses.fields(CriticConfig), *dataclasses.fields(OpdConfig))}
    used = set(re.findall(r"`(--[a-z0-9-]+)", PAGE))
    used = {"--" + f[5:] if f.startswith("--no-") and "--" + f[5:] in flags else f for f in used}  # --no-x of a bool
    assert used - flags == set(), "the page names flags that AlgoConfig does not have"
    assert flags - used == set(), "AlgoConfig flags missing from the page"


def test_every_emitted_metric_is_documented():
    cfg = make_cfg(use_kl_loss=True, kl_loss_coef=0.1, use_tis=True, entropy_coef=0.01)
    one = [T([-1.0, -1.2])]
    _, m = call_packed(
        policy_loss, cfg, log_probs=one, old_log_probs=one, advantages=[T([1.0, -1.0])], loss_masks=[T([1.0, 1.0])],
        ref_log_probs=[T([-1.1, -1.0])], rollout_log_probs=[T([-0.9, -1.3])], entropy=[T([0.5, 0.7])],
    )
    _, v = call_packed(value_loss, cfg, values=one, old_values=one, returns=one, loss_masks=[T([1.0, 1.0])])
    names = set(m) | set(v)
    for mis in (
        MisConfig(tis_mode="truncate", use_rs=True, rs_veto_threshold=0.01, tis_batch_normalize=True),
        MisConfig(tis_mode="clip"),
        MisConfig(tis_mode="mask"),
    ):
        _, _, mm = call_packed(mis_function, cfg, pg_loss=one, train_log_probs=one, rollout_log_probs=[T([-0.9, -1.3])], loss_masks=[T([1.0, 1.0])], mis=mis)
        names |= set(mm)
    documented = set(re.findall(r"`([a-z0-9_]+)`", PAGE))
    missing = {n for n in names if n not in documented and n.removeprefix("mis_") not in documented}
    assert not missing, f"metrics missing from docs/algorithms.md: {sorted(missing)}"
