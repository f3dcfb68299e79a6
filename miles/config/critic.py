"""Critic options (`cfg.critic`): the value model PPO trains beside the policy (`--advantage-estimator ppo`).

The critic is the policy's architecture with its LM head replaced by a scalar value head; it is a
second train group that runs the same RL step as the actor (`miles.train.step.train_critic`). Flag
names and defaults are upstream's. Upstream places the critic on the actor's devices with the
actor's parallelism, so its node/GPU counts default to the actor's, and any other value is refused.

Every option here is for PPO only: set without `--advantage-estimator ppo` it exits 2 (`check`).
The critic is saved inside each `--save` checkpoint (its `critic/` directory), committed by the same
tracker as the actor's shards, so the two always resume together (upstream's separate
`<save>_critic` directory can resume a critic from a different step than its actor).

Nothing heavy is imported here: `miles --help` reads these declarations.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from miles.config.fields import Derived, flag_name, option
from miles.errors import UserError


def _ppo(c) -> bool:
    return c.algo.advantage_estimator == "ppo"


@dataclass
class CriticConfig:
    """The PPO critic: where it starts from, its placement and its optimizer schedule."""

    critic_num_nodes: int | None = option(
        help="Nodes of the critic's train group (it shares the actor's devices and layout).",
        derived=Derived("--actor-num-nodes with --advantage-estimator ppo", lambda c: c.cluster.actor_num_nodes if _ppo(c) else None),
    )
    critic_num_gpus_per_node: int | None = option(
        help="Devices per node of the critic's train group (it shares the actor's devices and layout).",
        derived=Derived(
            "--actor-num-gpus-per-node with --advantage-estimator ppo",
            lambda c: c.cluster.actor_num_gpus_per_node if _ppo(c) else None,
        ),
    )
    critic_load: str | None = option(
        help="Hugging Face directory of the policy's architecture that the critic's decoder starts from "
        "(its value head starts at N(0, 0.02)); a resumed run restores the critic from its checkpoint instead.",
        derived=Derived("--hf-checkpoint with --advantage-estimator ppo", lambda c: c.rollout.hf_checkpoint if _ppo(c) else None),
    )
    critic_save: str | None = option(
        None,
        help="Upstream's separate critic checkpoint directory.",
        unsupported="the critic is saved inside each --save checkpoint (its critic/ directory), committed with the actor's "
        "by one tracker so the two always resume together",
    )
    critic_lr: float | None = option(
        help="Peak learning rate of the critic.",
        derived=Derived("--lr with --advantage-estimator ppo", lambda c: c.optimizer.lr if _ppo(c) else None),
    )
    critic_lr_warmup_iters: int = option(
        0, help="Critic optimizer steps of linear warm-up from 0 to --critic-lr (the decay follows --lr-decay-style)."
    )
    num_critic_only_steps: int = option(
        0,
        help="The first this many rollouts train only the critic (the policy is not updated), so the policy's first "
        "updates use fitted values.",
    )

    def check_before_derive(self, cfg) -> None:
        """Before derived defaults are filled: a critic option set without ppo is an error."""
        if _ppo(cfg):
            return
        for f in fields(self):
            if f.metadata.get("unsupported"):
                continue  # resolve() names its own reason
            default = None if f.metadata.get("derived") else f.default
            if getattr(self, f.name) != default:
                raise UserError(
                    f"{flag_name(f)} configures the PPO critic, which only --advantage-estimator ppo trains; "
                    f"add --advantage-estimator ppo or drop {flag_name(f)}.",
                    option=flag_name(f),
                )

    def check(self, cfg) -> None:
        """After derived defaults: the critic's layout is the actor's, values in range."""
        if not _ppo(cfg):
            return
        c = cfg.cluster
        for name, actor in (("critic_num_nodes", c.actor_num_nodes), ("critic_num_gpus_per_node", c.actor_num_gpus_per_node)):
            if getattr(self, name) != actor:
                flag = "--" + name.replace("_", "-")
                raise UserError(
                    f"{flag} {getattr(self, name)} differs from the actor's {actor}: the critic shares the actor's devices "
                    f"and layout; drop {flag}.",
                    option=flag,
                )
        if self.critic_lr < 0:
            raise UserError(f"--critic-lr {self.critic_lr} must be >= 0.", option="--critic-lr")
        if self.critic_lr_warmup_iters < 0:
            raise UserError(f"--critic-lr-warmup-iters {self.critic_lr_warmup_iters} must be >= 0.", option="--critic-lr-warmup-iters")
        if self.num_critic_only_steps < 0:
            raise UserError(f"--num-critic-only-steps {self.num_critic_only_steps} must be >= 0.", option="--num-critic-only-steps")
        if cfg.algo.kl_coef != 0:
            raise UserError(
                "--kl-coef puts a KL penalty into the rewards, but the PPO critic trains before the actor and never sees "
                "reference log-probs, so its value targets would miss it; use --use-kl-loss with --kl-loss-coef instead.",
                option="--kl-coef",
            )
