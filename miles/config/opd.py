"""On-policy distillation options (`cfg.opd`): a teacher's log-probs of the student's sampled tokens
shape the policy's advantages (upstream's `--use-opd`).

Per trained token the reverse-KL estimate `student_logp - teacher_logp` (the student's log-probs are
the old ones the advantages use) is subtracted, times `--opd-kl-coef`, from the advantages the
estimator computed, before `--normalize-advantages` (miles/algo/opd.py). It is no loss term: nothing
differentiates through the teacher, and PPO's critic never sees it. Two ways to get the teacher's
log-probs, upstream's names:

- `--opd-type megatron`: the trainer loads `--opd-teacher-load` (a Hugging Face directory of a model
  with the student's vocabulary) beside the actor and runs a no-grad forward of it every rollout; it
  is never optimised and never saved. (Upstream's name says which trainer does it there; in miles
  the torch trainer runs it.)
- `--opd-type sglang`: an engine serving the teacher (`--opd-teacher-urls`, an SGLang server or
  miles' built-in engine server) scores every sample's tokens on the rollout side.

`check_before_derive` refuses OPD options without `--use-opd`; `check` refuses an OPD run without its
teacher, one sentence each. The teacher's vocabulary is compared with the student's by
`miles.validate_inputs`. Nothing heavy is imported here: `miles --help` reads these declarations.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Literal

from miles.config.fields import flag_name, option
from miles.config.trainer_support import not_yet
from miles.errors import UserError

OpdType = Literal["sglang", "megatron"]


@dataclass
class OpdConfig:
    """On-policy distillation: which teacher, and how strongly its reverse KL shapes the advantages."""

    use_opd: bool = option(
        False,
        help="On-policy distillation: subtract --opd-kl-coef x (student log-prob - teacher log-prob) of every sampled "
        "token from its advantage; needs --opd-type and its teacher.",
    )
    opd_type: OpdType | None = option(
        None,
        help="Where the teacher's log-probs come from, needed with --use-opd: megatron (the trainer forwards "
        "--opd-teacher-load itself) or sglang (an engine serving the teacher at --opd-teacher-urls scores the samples)."
        + not_yet("opd_type"),
    )
    opd_kl_coef: float = option(1.0, help="Weight of the per-token reverse KL (student - teacher log-prob) subtracted from the advantages.")
    opd_teacher_load: str | None = option(
        None,
        help="Hugging Face directory of the teacher (the student's vocabulary) that --opd-type megatron forwards in the "
        "trainer, without gradient; it is never trained or saved.",
    )
    opd_teacher_urls: list[str] | None = option(
        None,
        help="The engine serving the teacher for --opd-type sglang: its base URL (http://host:port, an SGLang server or "
        "`python -m miles.rollout.engine.server`), which scores each sample's tokens on /generate.",
    )

    def check_before_derive(self, cfg) -> None:
        """An OPD option set without --use-opd is an error (upstream refuses the teacher flags)."""
        if self.use_opd:
            return
        for f in fields(self):
            if f.name != "use_opd" and getattr(self, f.name) != f.default:
                raise UserError(
                    f"{flag_name(f)} configures on-policy distillation, which is off; add --use-opd or drop {flag_name(f)}.",
                    option=flag_name(f),
                )

    def check(self, cfg) -> None:
        """With --use-opd: the type, its teacher (and only its teacher), values in range."""
        if not self.use_opd:
            return
        if self.opd_type is None:
            raise UserError(
                "--use-opd needs --opd-type: megatron (the trainer forwards --opd-teacher-load) or sglang (an engine at "
                "--opd-teacher-urls scores the samples).",
                option="--opd-type",
            )
        if self.opd_type == "megatron":
            if not self.opd_teacher_load:
                raise UserError(
                    "--use-opd --opd-type megatron needs the teacher: give --opd-teacher-load (a Hugging Face model directory).",
                    option="--opd-teacher-load",
                )
            if self.opd_teacher_urls:
                raise UserError(
                    "--opd-teacher-urls is for --opd-type sglang; the megatron type forwards --opd-teacher-load in the trainer, "
                    "so drop --opd-teacher-urls.",
                    option="--opd-teacher-urls",
                )
        else:
            if not self.opd_teacher_urls:
                raise UserError(
                    "--use-opd --opd-type sglang needs the teacher's engine: give --opd-teacher-urls http://host:port.",
                    option="--opd-teacher-urls",
                )
            if self.opd_teacher_load:
                raise UserError(
                    "--opd-teacher-load is for --opd-type megatron; the sglang type reads the teacher from --opd-teacher-urls, "
                    "so drop --opd-teacher-load.",
                    option="--opd-teacher-load",
                )
            if len(self.opd_teacher_urls) != 1:
                raise UserError(
                    f"--opd-teacher-urls got {len(self.opd_teacher_urls)} URLs; miles scores with one teacher engine, give one.",
                    option="--opd-teacher-urls",
                )
            url = self.opd_teacher_urls[0]
            if "=" in url.split("://")[0] or not url.startswith(("http://", "https://")):
                raise UserError(
                    f"--opd-teacher-urls {url!r} is not a base URL; give http://host:port (upstream's NAME=URL routing by "
                    "sample metadata is not supported).",
                    option="--opd-teacher-urls",
                )
        if self.opd_kl_coef < 0:
            raise UserError(f"--opd-kl-coef {self.opd_kl_coef} must be >= 0.", option="--opd-kl-coef")
        if cfg.algo.loss_type == "sft_loss":
            raise UserError(
                "--use-opd shapes the policy's advantages, which --loss-type sft_loss does not use; drop one of them.",
                option="--use-opd",
            )
