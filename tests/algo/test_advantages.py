import math
import statistics

import pytest
import torch

from grpoflow.algo import combine_rewards, group_advantages, group_reward_std, normalize_then_sum_advantages

NAN = float("nan")


def reference_advantages(rewards: list[float], num_generations: int, scale_rewards: str) -> list[float]:
    """Group by group with the standard library, skipping NaNs."""

    def valid(values):
        return [value for value in values if not math.isnan(value)]

    def stdev(values):
        return statistics.stdev(values) if len(values) > 1 else 0.0

    batch_std = stdev(valid(rewards))
    advantages = []
    for start in range(0, len(rewards), num_generations):
        group = rewards[start : start + num_generations]
        group_valid = valid(group)
        mean = statistics.fmean(group_valid) if group_valid else 0.0
        divisor = {"group": stdev(group_valid) + 1e-4, "batch": batch_std + 1e-4, "none": 1.0}[scale_rewards]
        advantages += [0.0 if math.isnan(r) else (r - mean) / divisor for r in group]
    return advantages


@pytest.mark.parametrize(
    ("scale_rewards", "magnitude"),
    [("group", 0.5 / (math.sqrt(0.5) + 1e-4)), ("batch", 0.5 / (math.sqrt(1 / 3) + 1e-4)), ("none", 0.5)],
)
def test_two_groups_of_two_closed_form(scale_rewards, magnitude):
    advantages, metrics = group_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]), 2, scale_rewards)
    torch.testing.assert_close(advantages, magnitude * torch.tensor([1.0, -1.0, -1.0, 1.0]))
    assert metrics["reward"].item() == pytest.approx(0.5)
    assert metrics["reward_std"].item() == pytest.approx(math.sqrt(1 / 3))
    assert metrics["reward_group_std"].item() == pytest.approx(math.sqrt(0.5))
    assert metrics["frac_reward_zero_std"].item() == 0.0


def test_missing_rewards_are_left_out_and_get_zero_advantage():
    rewards = torch.tensor([1.0, NAN, 3.0, 2.0, 2.0, 2.0, NAN, NAN, 5.0, NAN, NAN, NAN])
    advantages, metrics = group_advantages(rewards, 3, "group")
    one = 1.0 / (math.sqrt(2.0) + 1e-4)
    torch.testing.assert_close(advantages, torch.tensor([-one, 0, one, 0, 0, 0, 0, 0, 0, 0, 0, 0]))
    assert metrics["frac_reward_zero_std"].item() == pytest.approx(3 / 4)
    assert metrics["reward"].item() == pytest.approx(15 / 6)
    assert not torch.isnan(advantages).any()


@pytest.mark.parametrize("scale_rewards", ["group", "batch", "none"])
def test_matches_reference_on_random_rewards(scale_rewards):
    generator = torch.Generator().manual_seed(1)
    rewards = torch.randn(24, generator=generator, dtype=torch.float64)
    rewards[torch.rand(24, generator=generator) < 0.2] = NAN
    rewards[4:8] = 0.25  # one group without spread
    advantages, _ = group_advantages(rewards, 4, scale_rewards)
    expected = torch.tensor(reference_advantages(rewards.tolist(), 4, scale_rewards), dtype=torch.float64)
    torch.testing.assert_close(advantages, expected)


def test_bool_aliases_and_unknown_mode():
    rewards = torch.tensor([1.0, 0.0, 2.0, 0.5])
    torch.testing.assert_close(
        group_advantages(rewards, 2, True)[0], group_advantages(rewards, 2, "group")[0]
    )
    torch.testing.assert_close(
        group_advantages(rewards, 2, False)[0], group_advantages(rewards, 2, "none")[0]
    )
    with pytest.raises(ValueError, match=r"\['batch', 'group', 'none'\]"):
        group_advantages(rewards, 2, "groups")


def test_rejects_partial_groups():
    with pytest.raises(ValueError, match="multiple of num_generations"):
        group_advantages(torch.zeros(5), 2)


def test_group_reward_std_uses_n_minus_one():
    std = group_reward_std(torch.tensor([1.0, 2.0, 3.0, 4.0, NAN, NAN]), 3)
    torch.testing.assert_close(std, torch.tensor([1.0, 0.0]))


def test_combine_rewards_skips_missing_but_keeps_all_missing_rows_missing():
    rewards = torch.tensor([[1.0, 2.0], [NAN, 3.0], [NAN, NAN], [0.0, NAN]])
    combined = combine_rewards(rewards, torch.tensor([1.0, 0.5]))
    torch.testing.assert_close(combined, torch.tensor([2.0, 1.5, NAN, 0.0]), equal_nan=True)
    with pytest.raises(ValueError, match="num_funcs"):
        combine_rewards(rewards, torch.tensor([1.0]))


@pytest.mark.parametrize("scale_rewards", ["group", "batch", "none"])
def test_groups_of_different_sizes_match_each_group_computed_alone(scale_rewards):
    rewards = torch.tensor([1.0, 0.0, 0.5, 2.0, 0.0, float("nan"), 3.0, 1.0, 1.0])
    sizes = [3, 4, 2]
    advantages, metrics = group_advantages(rewards, sizes, scale_rewards)
    assert advantages.shape == rewards.shape
    start = 0
    batch_std = rewards[~rewards.isnan()].std()
    for size in sizes:
        part = rewards[start : start + size]
        valid = part[~part.isnan()]
        divisor = {"group": valid.std() + 1e-4, "batch": batch_std + 1e-4, "none": 1.0}[scale_rewards]
        expected = torch.nan_to_num((part - valid.mean()) / divisor, nan=0.0)
        torch.testing.assert_close(advantages[start : start + size], expected)
        start += size
    assert metrics["frac_reward_zero_std"] == pytest.approx(1 / 3)


def test_group_sizes_must_cover_the_rewards():
    with pytest.raises(ValueError, match="do not split the 4 rewards"):
        group_advantages(torch.zeros(4), [2, 3])


def test_normalize_then_sum_normalizes_each_reward_in_its_group_then_the_sum_over_the_batch():
    # Function 0 spreads 0/1 in one group, function 1 spreads 0/100 in the other: after per-group
    # normalisation both groups carry about the same signal, +-(d / 2) / (std + 1e-4).
    rewards = torch.tensor([[1.0, 5.0], [0.0, 5.0], [3.0, 100.0], [3.0, 0.0]], dtype=torch.float64)
    advantages, metrics = normalize_then_sum_advantages(rewards, torch.tensor([1.0, 1.0]), 2)
    small, large = 0.5 / (math.sqrt(0.5) + 1e-4), 50 / (math.sqrt(5000) + 1e-4)
    aggregate = torch.tensor([small, -small, large, -large], dtype=torch.float64)
    expected = (aggregate - aggregate.mean()) / (aggregate.std() + 1e-4)
    torch.testing.assert_close(advantages, expected)
    assert metrics["reward"].item() == pytest.approx((6 + 5 + 103 + 3) / 4)
    by_sizes, _ = normalize_then_sum_advantages(rewards, torch.tensor([1.0, 1.0]), [2, 2])
    torch.testing.assert_close(by_sizes, advantages)
