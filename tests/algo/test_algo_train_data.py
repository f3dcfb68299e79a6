"""samples_to_train_data: reward normalisation per prompt group, dict rewards, masks, truncation, hooks."""

from __future__ import annotations

import pytest

from algo_hand_checks import T, check_train_data_rewards, close, make_cfg, make_samples
from miles.errors import UserError
from miles.rollout.train_data import samples_to_train_data
from miles.sample import SampleStatus


def convert(samples, n=4, reward_key=None, **cfg):
    return samples_to_train_data(samples, algo=make_cfg(**cfg), n_samples_per_prompt=n, reward_key=reward_key)


def test_grpo_rewards_are_group_normalised():
    check_train_data_rewards()


def test_two_groups_are_normalised_separately_and_raw_rewards_kept():
    data = convert(make_samples([1.0, 0.0, 0.0, 1.0, 0.5, 0.5, 0.5, 0.5]))
    a = 0.8660239038
    close(T(data["rewards"]), [a, -a, -a, a, 0, 0, 0, 0])  # all-equal group -> 0
    assert data["raw_reward"] == [1.0, 0.0, 0.0, 1.0, 0.5, 0.5, 0.5, 0.5]


@pytest.mark.parametrize(
    "cfg, expected",
    [
        (dict(disable_grpo_std_normalization=True), [0.5, -0.5, -0.5, 0.5]),
        (dict(advantage_estimator="reinforce_plus_plus_baseline"), [0.5, -0.5, -0.5, 0.5]),  # no std division
        (dict(disable_rewards_normalization=True), [1.0, 0.0, 0.0, 1.0]),
        (dict(advantage_estimator="reinforce_plus_plus"), [1.0, 0.0, 0.0, 1.0]),
        (dict(advantage_estimator="ppo"), [1.0, 0.0, 0.0, 1.0]),
    ],
)
def test_normalisation_per_estimator(cfg, expected):
    close(T(convert(make_samples([1.0, 0.0, 0.0, 1.0]), **cfg)["rewards"]), expected)


def test_single_sample_groups_are_centred_to_zero_without_std():
    data = convert(make_samples([0.3, 1.0]), n=1)
    close(T(data["rewards"]), [0.0, 0.0])


def test_groups_by_group_index_allow_unequal_sizes():
    samples = make_samples([1.0, 0.0, 1.0, 5.0, 1.0])
    for s, g in zip(samples, [0, 0, 0, 1, 1]):
        s.group_index = g
    data = convert(samples, n=3, disable_grpo_std_normalization=True)
    # group 0 mean 2/3 -> [1/3, -2/3, 1/3]; group 1 mean 3 -> [2, -2]
    close(T(data["rewards"]), [1 / 3, -2 / 3, 1 / 3, 2.0, -2.0])


def test_ragged_batch_without_group_index_is_rejected():
    with pytest.raises(ValueError, match="groups of"):
        convert(make_samples([1.0, 0.0, 1.0]), n=2)


def test_dict_rewards_need_a_present_reward_key():
    samples = make_samples([{"acc": 1.0, "len": 3.0}, {"acc": 0.0, "len": 1.0}])
    data = convert(samples, n=2, reward_key="acc", disable_rewards_normalization=True)
    assert data["raw_reward"] == [1.0, 0.0]
    with pytest.raises(UserError, match="--reward-key"):
        convert(samples, n=2)
    with pytest.raises(UserError, match="'score' is not in"):
        convert(samples, n=2, reward_key="score")


def test_masks_truncation_indices_and_rollout_log_probs():
    samples = make_samples([1.0, 0.0], response_length=3)
    samples[0].loss_mask = [1, 0, 1]
    samples[1].status = SampleStatus.TRUNCATED
    for s in samples:
        s.rollout_log_probs = [-0.1, -0.2, -0.3]
    data = convert(samples, n=2)
    assert data["loss_masks"] == [[1, 0, 1], [1, 1, 1]]
    assert data["truncated"] == [0, 1]
    assert data["sample_indices"] == [0, 1]
    assert data["response_lengths"] == [3, 3]
    assert data["tokens"][1] == [7, 8, 9, 11, 11, 11]
    assert data["rollout_log_probs"][0] == [-0.1, -0.2, -0.3]


def test_empty_response_is_kept_with_empty_mask():
    samples = make_samples([1.0, 0.0], response_length=0)
    data = convert(samples, n=2)
    assert data["loss_masks"] == [[], []]
    close(T(data["rewards"]), [0.7071063, -0.7071063])  # ±0.5 / (sqrt(0.5) + 1e-6)


def test_mismatched_mask_or_log_probs_are_internal_errors():
    samples = make_samples([1.0, 0.0])
    samples[0].loss_mask = [1]
    with pytest.raises(ValueError, match="loss mask"):
        convert(samples, n=2)
    samples = make_samples([1.0, 0.0])
    samples[0].rollout_log_probs = [-1.0, -1.0]
    with pytest.raises(ValueError, match="rollout log-probs"):
        convert(samples, n=2)


def test_custom_hooks_replace_normalisation_or_conversion():
    samples = make_samples([1.0, 0.0])
    seen = []

    def post(args, s):
        seen.append(args)
        return [9.0, 8.0], [0.25, -0.25]

    data = samples_to_train_data(samples, algo=make_cfg(), n_samples_per_prompt=2, reward_key=None, custom_reward_post_process=post)
    assert data["rewards"] == [0.25, -0.25] and data["raw_reward"] == [9.0, 8.0]
    assert seen[0].advantage_estimator == "grpo"  # the AlgoConfig is passed as args by default
    data = samples_to_train_data(
        samples, algo=make_cfg(), n_samples_per_prompt=2, reward_key=None, custom_convert=lambda a, s: {"n": len(s)}
    )
    assert data == {"n": 2}


def test_equal_groups_are_normalised_in_one_call_bit_for_bit_like_one_group_at_a_time():
    """The vectorised path (all groups one size) gives exactly the per-group numbers, groups in any order."""
    import random

    import torch

    from miles.algo.advantages import normalize_group_rewards
    from miles.config.algo import AlgoConfig
    from miles.rollout.train_data import normalize_rewards

    rng = random.Random(0)
    for estimator in ("grpo", "reinforce_plus_plus_baseline"):
        algo = AlgoConfig(advantage_estimator=estimator)
        for n in (1, 2, 8):
            raw = [rng.choice((0.0, 1.0, rng.uniform(-3, 3))) for _ in range(32 * n)]
            index = list(range(len(raw)))
            rng.shuffle(index)  # groups by group_index need not be consecutive
            groups = [index[i : i + n] for i in range(0, len(raw), n)]
            expected = torch.empty(len(raw))
            for idx in groups:
                ix = torch.tensor(idx)
                expected[ix] = normalize_group_rewards(torch.tensor(raw)[ix], n, std_normalization=estimator == "grpo")
            got = normalize_rewards(raw, groups, algo)
            assert got == expected.tolist()
    mixed = normalize_rewards([1.0, 0.0, 1.0, 1.0, 0.0], [[0, 1], [2, 3, 4]], AlgoConfig(advantage_estimator="grpo"))
    assert mixed[:2] == pytest.approx([0.7071, -0.7071], abs=1e-4) and sum(mixed[2:]) == pytest.approx(0.0, abs=1e-6)
