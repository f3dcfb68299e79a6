"""Algorithm options (`cfg.algo`): advantage estimator, policy/value/SFT loss, KL, entropy, rollout correction.

Field names are the upstream flag names in snake_case (`--eps-clip-high` -> `eps_clip_high`), with
upstream defaults. `AlgoConfig.check(n_samples_per_prompt)` rejects contradictory combinations with a
`UserError` naming the flags and the fix; the lead's `resolve()` calls it after derived defaults
(`eps_clip_high`) are filled. The maths these options drive lives in `miles/algo/` and is written
out in `docs/algorithms.md`.

Also here: `MisConfig`, the YAML of `--custom-config-path` read by the built-in MIS rollout-correction
function (`miles.algo.rollout_correction.mis_function`), so that a bad YAML is rejected while the
configuration is resolved, before any model is loaded.

Nothing heavy is imported here (no torch): `miles --help` reads these declarations.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from miles.config.fields import Derived, option
from miles.errors import UserError

AdvantageEstimator = Literal["grpo", "gspo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "ppo"]
LossType = Literal["policy_loss", "sft_loss", "custom_loss"]
KLType = Literal["k1", "k2", "k3", "low_var_kl"]

# Estimators whose rewards are centred on their prompt group's mean by samples_to_train_data.
GROUP_BASELINE_ESTIMATORS = ("grpo", "gspo", "reinforce_plus_plus_baseline")
# Estimators whose centred rewards are also divided by the group's std.
STD_NORMALIZED_ESTIMATORS = ("grpo", "gspo")

MIS_FUNCTION_PATH = "miles.algo.rollout_correction.mis_function"


@dataclass
class AlgoConfig:
    """Options of the RL objective: how rewards become advantages and advantages become a loss."""

    advantage_estimator: AdvantageEstimator = option(
        "grpo",
        help="How rewards become per-token advantages: grpo and gspo (group-normalised reward), "
        "reinforce_plus_plus (discounted return), reinforce_plus_plus_baseline (group-centred reward), "
        "ppo (GAE over the values of a critic trained beside the policy; the --critic-* options).",
    )
    eps_clip: float = option(0.2, help="PPO clip range below 1: the ratio is clipped to [1 - eps_clip, 1 + eps_clip_high].")
    eps_clip_high: float | None = option(
        help="PPO clip range above 1 (clip-higher).",
        derived=Derived("equal to --eps-clip", lambda c: c.algo.eps_clip),
    )
    eps_clip_c: float | None = option(
        None,
        help="Dual-clip PPO: for negative advantages the token loss is at most eps_clip_c * |advantage|; must be > 1; unset = off.",
    )
    value_clip: float = option(
        0.2,
        help="PPO value loss (the critic's): new values are clipped to old values ± value_clip; ppo only.",
    )
    kl_coef: float = option(
        0.0,
        help="Reward-level KL penalty: -kl_coef * KL(policy || reference) is added to every token's reward "
        "(reinforce_plus_plus, reinforce_plus_plus_baseline, ppo); excludes --use-kl-loss.",
    )
    loss_type: LossType = option(
        "policy_loss",
        help="Training objective: policy_loss (PPO surrogate), sft_loss (supervised fine-tuning: --prompt-data rows are "
        "chat conversations, trained on as they are, the negative log-likelihood of their assistant messages; "
        "miles.rollout.sft_rollout), or custom_loss (--custom-loss-function-path).",
    )
    custom_loss_function_path: str | None = option(
        None, help="Loss used with --loss-type custom_loss, as package.module.function or file.py:function."
    )
    kl_loss_type: KLType = option(
        "k1", help="KL estimator for --use-kl-loss and --kl-coef: k1 (log ratio), k2 (squared/2), k3, low_var_kl (clamped k3)."
    )
    use_kl_loss: bool = option(False, help="Add kl_loss_coef * KL(policy || reference) to the loss (needs a reference model).")
    kl_loss_coef: float = option(0.0, help="Weight of the KL loss term; used with --use-kl-loss.")
    use_unbiased_kl: bool = option(
        False, help="Multiply the per-token KL loss by the importance ratio policy/old policy (unbiased off-policy estimate)."
    )
    entropy_coef: float = option(0.0, help="Entropy bonus: the loss subtracts entropy_coef * mean token entropy.")
    gamma: float = option(1.0, help="Discount factor for reinforce_plus_plus returns and PPO GAE.")
    lambd: float = option(1.0, help="GAE lambda for the ppo estimator; ppo only.")
    normalize_advantages: bool = option(
        False, help="Whiten advantages over the batch's trained tokens (zero mean, unit variance); required by reinforce_plus_plus*."
    )
    disable_grpo_std_normalization: bool = option(
        False, help="grpo/gspo: only subtract the group mean from rewards, do not divide by the group std (Dr. GRPO)."
    )
    disable_rewards_normalization: bool = option(
        False, help="Train on raw rewards: no group mean subtraction or std division for grpo, gspo, reinforce_plus_plus_baseline."
    )
    calculate_per_token_loss: bool = option(
        False, help="Average the loss over all trained tokens of the batch instead of per sample then over samples."
    )
    use_tis: bool = option(
        False,
        help="Truncated importance sampling: weight the policy loss by clamp(exp(train logprob - rollout logprob), "
        "tis_clip_low, tis_clip) to correct the rollout engine's mismatch.",
    )
    tis_clip: float = option(2.0, help="Upper bound of the truncated importance weight (--use-tis).")
    tis_clip_low: float = option(0.0, help="Lower bound of the truncated importance weight (--use-tis).")
    custom_tis_function_path: str | None = option(
        None,
        help=f"Replaces the built-in TIS under --use-tis; {MIS_FUNCTION_PATH} is the built-in MIS configured by --custom-config-path.",
    )
    custom_config_path: str | None = option(
        None, help="YAML of rollout-correction settings read by the MIS function (tis_mode, tis_level, bounds, use_rs, rs_*, ...)."
    )
    use_rollout_logprobs: bool = option(
        False,
        help="Use the rollout engine's logprobs as the old policy in the PPO ratio instead of recomputing them; excludes --use-tis.",
    )

    def check(self, n_samples_per_prompt: int) -> None:
        """Raise `UserError` for a contradictory or out-of-range combination of algorithm options."""
        if n_samples_per_prompt < 1:
            raise UserError(
                f"--n-samples-per-prompt is {n_samples_per_prompt}; give at least 1 response per prompt.",
                option="--n-samples-per-prompt",
            )
        if self.kl_coef != 0 and (self.use_kl_loss or self.kl_loss_coef != 0):
            raise UserError(
                "--kl-coef (KL in the reward) and --use-kl-loss/--kl-loss-coef (KL in the loss) are mutually exclusive; keep one of them.",
                option="--kl-coef",
            )
        if self.kl_coef != 0 and self.advantage_estimator in STD_NORMALIZED_ESTIMATORS:
            raise UserError(
                f"--kl-coef puts KL into per-token rewards, which --advantage-estimator {self.advantage_estimator} ignores; "
                "use --use-kl-loss with --kl-loss-coef instead.",
                option="--kl-coef",
            )
        if self.kl_loss_coef != 0 and not self.use_kl_loss:
            raise UserError(
                f"--kl-loss-coef {self.kl_loss_coef} has no effect without --use-kl-loss; add --use-kl-loss or drop --kl-loss-coef.",
                option="--kl-loss-coef",
            )
        if self.advantage_estimator.startswith("reinforce_plus_plus") and not self.normalize_advantages:
            raise UserError(
                f"--advantage-estimator {self.advantage_estimator} requires --normalize-advantages; add it.",
                option="--normalize-advantages",
            )
        if self.use_rollout_logprobs and self.use_tis:
            raise UserError(
                "--use-rollout-logprobs makes the rollout logprobs the old policy, so --use-tis would weight by exactly 1; drop one of them.",
                option="--use-tis",
            )
        if self.loss_type == "custom_loss" and not self.custom_loss_function_path:
            raise UserError(
                "--loss-type custom_loss needs --custom-loss-function-path package.module.function.",
                option="--custom-loss-function-path",
            )
        if self.custom_loss_function_path and self.loss_type != "custom_loss":
            raise UserError(
                f"--custom-loss-function-path is only used with --loss-type custom_loss (got {self.loss_type}); set it or drop the path.",
                option="--custom-loss-function-path",
            )
        if self.eps_clip_c is not None and self.eps_clip_c <= 1.0:
            raise UserError(
                f"--eps-clip-c {self.eps_clip_c} must be greater than 1 (dual-clip PPO caps the loss at eps_clip_c * |advantage|); unset it to turn dual clip off.",
                option="--eps-clip-c",
            )
        if not 0.0 <= self.eps_clip < 1.0:
            raise UserError(f"--eps-clip {self.eps_clip} must be in [0, 1).", option="--eps-clip")
        if self.eps_clip_high is not None and self.eps_clip_high < 0:
            raise UserError(f"--eps-clip-high {self.eps_clip_high} must be >= 0.", option="--eps-clip-high")
        if self.advantage_estimator != "ppo":
            for flag, name in (("--value-clip", "value_clip"), ("--lambd", "lambd")):
                if getattr(self, name) != AlgoConfig.__dataclass_fields__[name].default:
                    raise UserError(
                        f"{flag} configures the PPO critic's training, which only --advantage-estimator ppo runs; "
                        f"add --advantage-estimator ppo or drop {flag}.",
                        option=flag,
                    )
        if self.value_clip < 0:
            raise UserError(f"--value-clip {self.value_clip} must be >= 0.", option="--value-clip")
        for flag, value in (("--gamma", self.gamma), ("--lambd", self.lambd)):
            if not 0.0 <= value <= 1.0:
                raise UserError(f"{flag} {value} must be in [0, 1].", option=flag)
        if not 0.0 <= self.tis_clip_low <= self.tis_clip:
            raise UserError(
                f"--tis-clip-low {self.tis_clip_low} and --tis-clip {self.tis_clip} must satisfy 0 <= tis_clip_low <= tis_clip.",
                option="--tis-clip-low",
            )
        if self.custom_tis_function_path and not self.use_tis:
            raise UserError(
                "--custom-tis-function-path is only called under --use-tis; add --use-tis or drop the path.",
                option="--custom-tis-function-path",
            )
        if self.custom_tis_function_path == MIS_FUNCTION_PATH:
            if not self.custom_config_path:
                raise UserError(
                    f"the MIS function {MIS_FUNCTION_PATH} reads its settings from --custom-config-path; give a YAML file.",
                    option="--custom-config-path",
                )
            load_mis_config(self.custom_config_path)


@dataclass(frozen=True)
class MisConfig:
    """Settings of the MIS rollout correction, read from the YAML of `--custom-config-path`.

    Key names follow upstream's `mis.yaml` so existing files keep working; see docs/algorithms.md.
    """

    use_tis: bool = True
    """Apply the importance weights (false: only report mismatch metrics)."""
    tis_mode: Literal["truncate", "clip", "mask"] = "truncate"
    tis_level: Literal["token", "sequence", "geometric"] = "token"
    tis_lower_bound: float | None = None
    """Unset: 1 / tis_upper_bound."""
    tis_upper_bound: float = 2.0
    use_rs: bool = False
    rs_level: Literal["token", "sequence", "geometric"] = "token"
    rs_lower_bound: float | None = None
    """Unset: the (resolved) tis_lower_bound."""
    rs_upper_bound: float | None = None
    """Unset: tis_upper_bound."""
    rs_veto_threshold: float | None = None
    tis_batch_normalize: bool = False

    @property
    def resolved_tis_lower_bound(self) -> float:
        return self.tis_lower_bound if self.tis_lower_bound is not None else 1.0 / self.tis_upper_bound

    @property
    def resolved_rs_lower_bound(self) -> float:
        return self.rs_lower_bound if self.rs_lower_bound is not None else self.resolved_tis_lower_bound

    @property
    def resolved_rs_upper_bound(self) -> float:
        return self.rs_upper_bound if self.rs_upper_bound is not None else self.tis_upper_bound

    @classmethod
    def from_mapping(cls, data: dict[str, Any], *, source: str = "--custom-config-path") -> "MisConfig":
        """Validate a parsed YAML mapping; every problem is a `UserError` naming `source` and the key."""
        known = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - set(known))
        if unknown:
            raise UserError(
                f"{source}: unknown MIS key(s) {', '.join(unknown)}; known keys are {', '.join(known)}.",
                option="--custom-config-path",
            )
        choices = {
            "tis_mode": ("truncate", "clip", "mask"),
            "tis_level": ("token", "sequence", "geometric"),
            "rs_level": ("token", "sequence", "geometric"),
        }
        for key, allowed in choices.items():
            if key in data and data[key] not in allowed:
                raise UserError(
                    f"{source}: {key} is {data[key]!r}; choose one of {', '.join(allowed)}.", option="--custom-config-path"
                )
        for key in ("use_tis", "use_rs", "tis_batch_normalize"):
            if key in data and not isinstance(data[key], bool):
                raise UserError(f"{source}: {key} must be true or false, got {data[key]!r}.", option="--custom-config-path")
        for key in ("tis_lower_bound", "tis_upper_bound", "rs_lower_bound", "rs_upper_bound", "rs_veto_threshold"):
            value = data.get(key)
            # YAML reads `1e-4` (no dot) as a string; say so rather than failing later in a comparison.
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0):
                raise UserError(
                    f"{source}: {key} must be a positive number (write 1.0e-4, not 1e-4), got {value!r}.",
                    option="--custom-config-path",
                )
        cfg = cls(**{k: (float(v) if isinstance(v, int) and not isinstance(v, bool) else v) for k, v in data.items()})
        if cfg.tis_mode != "truncate" and not cfg.resolved_tis_lower_bound < cfg.tis_upper_bound:
            raise UserError(
                f"{source}: tis_lower_bound {cfg.resolved_tis_lower_bound} must be below tis_upper_bound {cfg.tis_upper_bound}.",
                option="--custom-config-path",
            )
        if cfg.use_rs and not cfg.resolved_rs_lower_bound < cfg.resolved_rs_upper_bound:
            raise UserError(
                f"{source}: rs_lower_bound {cfg.resolved_rs_lower_bound} must be below rs_upper_bound {cfg.resolved_rs_upper_bound}.",
                option="--custom-config-path",
            )
        if cfg.tis_batch_normalize and cfg.tis_level == "geometric":
            raise UserError(
                f"{source}: tis_batch_normalize supports tis_level token or sequence, not geometric.",
                option="--custom-config-path",
            )
        return cfg


def load_mis_config(path: str) -> MisConfig:
    """Read and validate the MIS YAML at `path` (the value of `--custom-config-path`)."""
    import yaml

    file = Path(path)
    if not file.is_file():
        raise UserError(f"--custom-config-path {path}: file does not exist; give the MIS YAML file.", option="--custom-config-path")
    try:
        data = yaml.safe_load(file.read_text()) or {}
    except yaml.YAMLError as e:
        raise UserError(f"--custom-config-path {path} is not valid YAML ({e}).", option="--custom-config-path") from None
    if not isinstance(data, dict):
        raise UserError(f"--custom-config-path {path} must hold a mapping of MIS keys to values.", option="--custom-config-path")
    return MisConfig.from_mapping(data, source=f"--custom-config-path {path}")
