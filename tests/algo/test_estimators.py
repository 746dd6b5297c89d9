import math
import statistics

import pytest
import torch

from grpoflow.algo import ADV_ESTIMATORS, adv_estimator, group_advantages, register_adv_estimator

NAN = float("nan")
REWARDS = [1.0, 0.0, 0.5, 2.0, 2.0, -1.0, 0.0, 3.0, NAN]
"""Three groups of three: spread, a tie and a missing reward."""


def reference(name: str, rewards: list[float], size: int) -> list[float]:
    """Straight from the formulas, with Python floats, over groups of `size`."""
    groups = [rewards[start : start + size] for start in range(0, len(rewards), size)]
    valid = [[r for r in group if r == r] for group in groups]
    out = []
    for group, kept in zip(groups, valid):
        for reward in group:
            if reward != reward:
                out.append(0.0)
            elif name == "rloo":
                others = list(kept)
                others.remove(reward)
                out.append(reward - statistics.fmean(others) if others else 0.0)
            elif name == "reinforce_plus_plus":
                out.append(reward)
            else:
                out.append(reward - statistics.fmean(kept))
    if name.startswith("reinforce_plus_plus"):
        present = [value for value, reward in zip(out, rewards) if reward == reward]
        mean, var = statistics.fmean(present), statistics.variance(present)
        out = [(v - mean) / math.sqrt(var + 1e-8) if r == r else 0.0 for v, r in zip(out, rewards)]
    return out


@pytest.mark.parametrize("name", ["rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline"])
def test_matches_the_closed_form(name):
    rewards = torch.tensor(REWARDS, dtype=torch.float64)
    advantages, metrics = adv_estimator(name)(rewards, 3, "group")
    torch.testing.assert_close(advantages, torch.tensor(reference(name, REWARDS, 3), dtype=torch.float64))
    _, grpo_metrics = group_advantages(rewards, 3)
    assert metrics.keys() == grpo_metrics.keys()
    for key, value in metrics.items():
        torch.testing.assert_close(value, grpo_metrics[key])


def test_rloo_is_the_scaled_group_centred_reward():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0])
    advantages, _ = adv_estimator("rloo")(rewards, 4, "group")
    torch.testing.assert_close(advantages, 4 / 3 * (rewards - 0.5))


@pytest.mark.parametrize("name", ["rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline"])
def test_groups_of_different_sizes(name):
    rewards = torch.tensor([1.0, 0.0, 0.5, 2.0, 4.0], dtype=torch.float64)
    advantages, _ = adv_estimator(name)(rewards, [3, 2], "group")
    padded = [1.0, 0.0, 0.5, 2.0, 4.0, NAN]
    expected = [value for value, reward in zip(reference(name, padded, 3), padded) if reward == reward]
    torch.testing.assert_close(advantages, torch.tensor(expected, dtype=torch.float64))


def test_a_lone_reward_has_no_leave_one_out_baseline():
    advantages, _ = adv_estimator("rloo")(torch.tensor([1.0, NAN, 3.0, 1.0]), 2, "group")
    torch.testing.assert_close(advantages, torch.tensor([0.0, 0.0, 2.0, -2.0]))


def test_registry_names_the_known_estimators_and_takes_plugins():
    assert {"grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline"} <= set(ADV_ESTIMATORS)
    with pytest.raises(ValueError, match=r"known: \[.*'reinforce_plus_plus_baseline', 'rloo'\]"):
        adv_estimator("ppo")

    def raw(rewards, num_generations, scale_rewards):
        return rewards.clone(), {}

    try:
        assert register_adv_estimator("raw_reward_test")(raw) is raw
        assert adv_estimator("raw_reward_test") is raw
        with pytest.raises(ValueError, match="already registered"):
            register_adv_estimator("rloo")(raw)
    finally:
        ADV_ESTIMATORS.pop("raw_reward_test", None)
