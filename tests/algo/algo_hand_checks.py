"""Hand-computed expectations for the algorithm layer, as `check_*` functions.

Each check calls the implementation through its module attribute (`kl.approx_kl`, not a
from-import), so `test_algo_mutations.py` can swap in a deliberately wrong variant and assert the
same check fails. The numbers are worked out in the comments; they are not produced by the code.
"""

from __future__ import annotations

import dataclasses

import torch

from miles.algo import advantages, kl, losses
from miles.algo.segments import Segments, pack
from miles.config.algo import AlgoConfig
from miles.rollout import train_data
from miles.sample import Sample, SampleStatus

T = torch.tensor


def make_cfg(**overrides) -> AlgoConfig:
    """An AlgoConfig with eps_clip_high filled by its declared Derived rule, as resolve() does."""
    cfg = AlgoConfig(**overrides)
    if cfg.eps_clip_high is None:
        rule = next(f for f in dataclasses.fields(AlgoConfig) if f.name == "eps_clip_high").metadata["derived"].rule
        cfg.eps_clip_high = rule(type("Root", (), {"algo": cfg})())
    return cfg


def make_samples(rewards, *, response_length: int = 2, group_size: int | None = None, **fields) -> list[Sample]:
    """Samples with 3 prompt tokens and `response_length` response tokens, indexed in order."""
    out = []
    for i, r in enumerate(rewards):
        out.append(
            Sample(
                tokens=[7, 8, 9] + [10 + i] * response_length,
                response_length=response_length,
                reward=r,
                status=SampleStatus.COMPLETED,
                index=i,
                group_index=None if group_size is None else i // group_size,
                **fields,
            )
        )
    return out


def packed(tensors):
    """Per-sample lists -> (flat [R] tensor, Segments): the call shape of miles.algo."""
    return pack(list(tensors))


def split(flat: torch.Tensor, seg: Segments) -> list[torch.Tensor]:
    return seg.split(flat)


def call_packed(fn, cfg, *, loss_masks, **per_sample):
    """Call a packed `miles.algo` loss with per-sample lists: each list is concatenated (torch.cat
    keeps the gradient path to the list's leaves) and `segments` is built from the mask lengths."""
    mask, seg = packed(loss_masks)
    kw = {k: (torch.cat(v) if isinstance(v, list) and v else (torch.zeros(0) if isinstance(v, list) else v)) for k, v in per_sample.items()}
    return fn(cfg, loss_mask=mask, segments=seg, **kw)


def close(actual: torch.Tensor | float, expected, tol: float = 1e-6) -> None:
    actual_t = torch.as_tensor(actual, dtype=torch.float64)
    expected_t = torch.as_tensor(expected, dtype=torch.float64)
    assert actual_t.shape == expected_t.shape, f"shape {tuple(actual_t.shape)} != {tuple(expected_t.shape)}"
    assert torch.allclose(actual_t, expected_t, atol=tol, rtol=0), f"got {actual_t.tolist()}, expected {expected_t.tolist()}"


def check_kl_hand_numbers() -> None:
    # r = log_probs - ref = [0.5, 0, -1]
    lp, ref = T([-1.0, -2.0, -0.5]), T([-1.5, -2.0, 0.5])
    close(kl.approx_kl(lp, ref, "k1"), [0.5, 0.0, -1.0])
    close(kl.approx_kl(lp, ref, "k2"), [0.125, 0.0, 0.5])  # r^2 / 2
    # k3: x = -r = [-0.5, 0, 1]; e^x - 1 - x = [e^-0.5 - 0.5, 0, e - 2]
    close(kl.approx_kl(lp, ref, "k3"), [0.1065306597, 0.0, 0.7182818285])
    close(kl.approx_kl(lp, ref, "low_var_kl"), [0.1065306597, 0.0, 0.7182818285])


def check_group_normalization() -> None:
    rewards = T([1.0, 0.0, 0.0, 1.0, 0.5, 0.5, 0.5, 0.5, 3.0, 1.0, 2.0, 2.0])
    out = advantages.normalize_group_rewards(rewards, 4)
    # group 1: mean 0.5, centred ±0.5, Bessel std sqrt(1/3) = 0.5773503 -> ±0.5 / (0.5773503 + 1e-6) = ±0.8660239
    # group 2: all equal -> 0 (0 / (0 + 1e-6))
    # group 3: mean 2, centred [1, -1, 0, 0], std sqrt(2/3) = 0.8164966 -> ±1.2247434
    a, b = 0.8660239038, 1.2247433714
    close(out, [a, -a, -a, a, 0, 0, 0, 0, b, -b, 0, 0])


def check_train_data_rewards() -> None:
    samples = make_samples([1.0, 0.0, 0.0, 1.0])
    data = train_data.samples_to_train_data(samples, algo=make_cfg(), n_samples_per_prompt=4, reward_key=None)
    a = 0.8660239038
    close(T(data["rewards"]), [a, -a, -a, a])


def check_policy_loss_hand_numbers() -> None:
    """PPO surrogate, eps_clip 0.2 / eps_clip_high 0.3, four samples, per-sample mean over 4 samples."""
    old, seg = packed([T([-1.0, -1.0, -1.0]), T([-1.0, -1.0]), T([-1.0]), T([])])
    ratios, _ = packed([T([1.5, 0.5, 1.1]), T([1.5, 0.5]), T([2.0]), T([])])
    lp = (old + ratios.log()).requires_grad_()
    adv, _ = packed([T([1.0, 1.0, 1.0]), T([-1.0, -1.0]), T([1.0]), T([])])
    masks, _ = packed([T([1.0, 1.0, 1.0]), T([1.0, 1.0]), T([0.0]), T([])])
    cfg = make_cfg(eps_clip=0.2, eps_clip_high=0.3)
    loss, m = losses.policy_loss(cfg, log_probs=lp, old_log_probs=old, advantages=adv, loss_mask=masks, segments=seg)
    # sample 1 (A=+1): rho 1.5 -> max(-1.5, -1.3) = -1.3 (clipped); rho 0.5 -> max(-0.5, -0.8) = -0.5; rho 1.1 -> -1.1
    #   mean (-1.3 - 0.5 - 1.1) / 3 = -0.9666667, clipfrac 1/3
    # sample 2 (A=-1): rho 1.5 -> max(1.5, 1.3) = 1.5; rho 0.5 -> max(0.5, 0.8) = 0.8 (clipped); mean 1.15, clipfrac 1/2
    # sample 3 fully masked -> 0; sample 4 empty -> 0; sum 0.1833333 / 4 samples = 0.0458333
    close(loss, 0.0458333333)
    close(m["pg_loss"], 0.0458333333)
    close(m["pg_clipfrac"], (1 / 3 + 1 / 2) / 4)
    loss.backward()
    # d/dlp of -rho*A / (3 * 4) = -rho*A/12 on unclipped tokens of sample 1; rho*1/(2*4) on sample 2
    grad = split(lp.grad, seg)
    close(grad[0], [0.0, -0.5 / 12, -1.1 / 12])
    close(grad[1], [1.5 / 8, 0.0])
    close(grad[2], [0.0])


def check_tis_hand_numbers() -> None:
    """--use-tis (vanilla TIS): per-token weight clamp(exp(old - rollout), tis_clip_low, tis_clip) on the
    PPO term; the PPO ratio is exp(logp - old) and stays inside its clip band here, so both show."""
    import math

    old, seg = packed([T([-1.0, -1.0, -1.0]), T([-1.0, -1.0])])
    # rollout = old - ln(rho): the engine's log-probs with rho = exp(old - rollout) = [3, 0.5, 1.5 | 0.25, 10]
    rho, _ = packed([T([3.0, 0.5, 1.5]), T([0.25, 10.0])])
    rollout = old - rho.log()
    # the current policy differs from the old one: log-ratio [0.1, -0.1, 0.05 | 0, 0]
    lp = (old + T([0.1, -0.1, 0.05, 0.0, 0.0])).requires_grad_()
    adv, _ = packed([T([1.0, -2.0, 0.5]), T([-1.0, 5.0])])
    masks, _ = packed([T([1.0, 1.0, 1.0]), T([1.0, 0.0])])
    cfg = make_cfg(use_tis=True, tis_clip=2.0, tis_clip_low=0.8)
    loss, m = losses.policy_loss(
        cfg, log_probs=lp, old_log_probs=old, advantages=adv, loss_mask=masks, segments=seg, rollout_log_probs=rollout
    )
    # weights w = clamp(rho, 0.8, 2) = [2, 0.8, 1.5 | 0.8, (masked)]
    # PPO ratio r = [e^0.1, e^-0.1, e^0.05 | 1] (inside [0.8, 1.2], unclipped); token loss -r * A * w:
    #   sample 1: -1.1051709*1*2 = -2.2103418, -0.9048374*(-2)*0.8 = 1.4477399, -1.0512711*0.5*1.5 = -0.7884533
    #     mean -1.5510553 / 3 = -0.5170184
    #   sample 2: -1*(-1)*0.8 = 0.8 (the masked token does not count); mean over 2 samples 0.1414908
    close(loss, 0.1414907851)
    close(m["pg_loss"], 0.1414907851)
    # metrics reduced like the loss (per-sample mean, then over samples), over trained tokens:
    close(m["tis"], ((3 + 0.5 + 1.5) / 3 + 0.25) / 2)  # mean rho before clamping
    close(m["tis_clipfrac"], (2 / 3 + 1) / 2)  # 3 and 0.5 clamped in sample 1; 0.25 in sample 2
    close(m["tis_abs"], ((2 + 0.5 + 0.5) / 3 + 0.75) / 2)  # mean |rho - 1|
    close(m["train_rollout_logprob_abs_diff"], ((math.log(3) + math.log(2) + math.log(1.5)) / 3 + math.log(4)) / 2)
    loss.backward()
    # d/dlp of -r*A*w / (n_tokens * 2 samples), the weight being data (no gradient through it)
    grad = split(lp.grad, seg)
    close(grad[0], [-2.2103418362 / 6, 1.4477398689 / 6, -0.7884533223 / 6])
    close(grad[1], [0.8 / 2, 0.0])
    # the upstream defaults (--tis-clip 2, --tis-clip-low 0) only truncate from above: w = [2, 0.5, 1.5 | 0.25]
    loss, _ = losses.policy_loss(
        make_cfg(use_tis=True), log_probs=lp.detach(), old_log_probs=old, advantages=adv, loss_mask=masks, segments=seg,
        rollout_log_probs=rollout,
    )
    # sample 1: -2.2103418 + 0.9048374*2*0.5 - 0.7884533 = -2.0939577, / 3 = -0.6979859; sample 2: 0.25
    close(loss, (-2.0939577 / 3 + 0.25) / 2)


def check_reinforce_plus_plus() -> None:
    cfg = make_cfg(advantage_estimator="reinforce_plus_plus", gamma=0.5, kl_coef=0.1, kl_loss_type="k1")
    # k1 kl = lp - ref = [0.5, 0, -1]; trained tokens 0 and 2 (token 1 is tool output)
    # token rewards: t0 = -0.1*0.5 = -0.05; t2 = -0.1*(-1) + 1.0 = 1.1
    # G2 = 1.1; G0 = -0.05 + 0.5 * 1.1 = 0.5 (the masked token is not a step)
    mask, seg = packed([T([1.0, 0.0, 1.0])])
    adv, ret = advantages.compute_advantages_and_returns(
        cfg,
        rewards=T([1.0]),
        loss_mask=mask,
        segments=seg,
        n_samples_per_prompt=1,
        log_probs=T([-1.0, -2.0, -3.0]),
        ref_log_probs=T([-1.5, -2.0, -2.0]),
    )
    close(adv, [0.5, 0.0, 1.1])
    close(ret, [0.5, 0.0, 1.1])


def check_gae() -> None:
    cfg = make_cfg(advantage_estimator="ppo", gamma=0.9, lambd=0.5)
    mask, seg = packed([T([1.0, 1.0, 1.0]), T([1.0, 0.0, 1.0])])
    values, _ = packed([T([0.5, 0.2, 0.4]), T([0.5, 9.0, 0.4])])
    adv, ret = advantages.compute_advantages_and_returns(
        cfg, rewards=T([1.0, 1.0]), loss_mask=mask, segments=seg, n_samples_per_prompt=1, values=values
    )
    adv, ret = split(adv, seg), split(ret, seg)
    # sample 1: d2 = 1 - 0.4 = 0.6; d1 = 0.9*0.4 - 0.2 = 0.16; d0 = 0.9*0.2 - 0.5 = -0.32
    #   A2 = 0.6; A1 = 0.16 + 0.45*0.6 = 0.43; A0 = -0.32 + 0.45*0.43 = -0.1265; returns A + V
    close(adv[0], [-0.1265, 0.43, 0.6])
    close(ret[0], [0.3735, 0.63, 1.0])
    # sample 2: masked middle token skipped: V = [0.5, 0.4]; d1 = 0.6, d0 = 0.9*0.4 - 0.5 = -0.14; A0 = -0.14 + 0.27 = 0.13
    close(adv[1], [0.13, 0.0, 0.6])
    close(ret[1], [0.63, 0.0, 1.0])


def check_per_sample_reduction() -> None:
    # SFT: per-sample mean -((-1 - 2)/2 + (-3)/1) / 2 = 2.25; per-token -(-6)/3 = 2
    lp, seg = packed([T([-1.0, -2.0]), T([-3.0])])
    masks, _ = packed([T([1.0, 1.0]), T([1.0])])
    loss, _ = losses.sft_loss(make_cfg(), log_probs=lp, loss_mask=masks, segments=seg)
    close(loss, 2.25)
    loss, _ = losses.sft_loss(make_cfg(calculate_per_token_loss=True), log_probs=lp, loss_mask=masks, segments=seg)
    close(loss, 2.0)

