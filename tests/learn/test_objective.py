"""The objective's options: reward aggregation into advantages, and short runs of the echo task
that still learn under each loss type, advantage estimator and regulariser."""

from __future__ import annotations

import pytest
import torch
from helpers.plugin_loss import ScaledSettings, scaled_loss
from helpers.support import recipe

from grpoflow import cli
from grpoflow.algo import (
    ADV_ESTIMATORS,
    ClipSettings,
    SapoSettings,
    combine_rewards,
    normalize_then_sum_advantages,
)
from grpoflow.learn.objective import AlgorithmConfig, batch_advantages
from grpoflow.options import load
from grpoflow.run.build import run

REWARDS = torch.tensor([[1.0, 0.0], [0.0, 2.0], [3.0, 1.0], [0.5, 0.5]])
WEIGHTS = torch.tensor([1.0, 0.5])


def test_batch_advantages_follow_the_estimator_and_the_aggregation():
    rloo = ADV_ESTIMATORS["rloo"]
    advantages, _ = batch_advantages(AlgorithmConfig(adv_estimator="rloo"), rloo, REWARDS, WEIGHTS, 2)
    torch.testing.assert_close(advantages, rloo(combine_rewards(REWARDS, WEIGHTS), 2, "group")[0])
    gdpo = AlgorithmConfig(multi_objective_aggregation="normalize_then_sum")
    advantages, _ = batch_advantages(gdpo, ADV_ESTIMATORS["grpo"], REWARDS, WEIGHTS, 2)
    torch.testing.assert_close(advantages, normalize_then_sum_advantages(REWARDS, WEIGHTS, 2)[0])


def test_kl_in_reward_subtracts_beta_times_the_completion_kl():
    grpo = ADV_ESTIMATORS["grpo"]
    kl = torch.tensor([0.0, 4.0, 1.0, 1.0])
    config = AlgorithmConfig(beta=0.5, kl_in_reward=True, scale_rewards="none")
    advantages, metrics = batch_advantages(config, grpo, REWARDS, WEIGHTS, 2, kl)
    rewards = combine_rewards(REWARDS, WEIGHTS)  # [1, 1, 3.5, 0.75]
    torch.testing.assert_close(advantages, torch.tensor([1.0, -1.0, 1.375, -1.375]))
    torch.testing.assert_close(metrics["reward"], rewards.mean())
    torch.testing.assert_close(metrics["reward_kl"], kl.mean())


def test_the_loss_settings_are_the_loss_types_own_section_of_the_options():
    config = load(
        AlgorithmConfig, {"loss_type": "sapo", "sapo_temperature_neg": "2", "epsilon": 0.1, "beta": 0.1}
    )
    settings = config.loss_settings()
    assert settings.surrogate_settings == SapoSettings(sapo_temperature_neg=2.0)
    assert (settings.loss_type, settings.beta, settings.kl_estimator) == ("sapo", 0.1, "k3")
    clipped = AlgorithmConfig(
        clip=ClipSettings(epsilon_high=0.28), kl_in_reward=True, beta=0.1
    ).loss_settings()
    assert clipped.surrogate_settings == ClipSettings(epsilon_high=0.28)
    assert clipped.beta == 0.0  # the KL goes into the reward


def test_a_registered_loss_type_is_an_option_listed_with_the_built_in_ones():
    with scaled_loss() as name:
        assert AlgorithmConfig(loss_type=name).loss_settings().surrogate() == ScaledSettings()
        assert load(AlgorithmConfig, {"loss_type": name}).loss_type == name
        assert (
            f"one of grpo, bnpo, dr_grpo, dapo, cispo, sapo, luspo, vespo, {name})" in cli.describe_options()
        )
        with pytest.raises(ValueError, match=f"loss_type must be one of grpo, .*, vespo, {name}; got 'ppo'"):
            load(AlgorithmConfig, {"loss_type": "ppo"})
    with pytest.raises(ValueError, match=f"loss_type must be one of grpo, .*, vespo, got '{name}'"):
        AlgorithmConfig(loss_type=name)


LEARNING_RUNS = {
    "cispo": (dict(loss_type="cispo", epsilon_high=5.0), "cispo_clip_ratio"),
    "sapo": (dict(loss_type="sapo"), "loss"),
    "luspo": (dict(loss_type="luspo", importance_sampling_level="sequence"), "clip_ratio/region_mean"),
    "vespo": (dict(loss_type="vespo"), "vespo/phi_seq_mean"),
    "entropy_coef": (dict(entropy_coef=0.01, top_entropy_quantile=0.5), "entropy_coef"),
    "rloo": (dict(adv_estimator="rloo"), "loss"),
    "reinforce_plus_plus_baseline": (dict(adv_estimator="reinforce_plus_plus_baseline"), "loss"),
    "kl_in_reward": (dict(beta=0.01, kl_in_reward=True, kl_estimator="low_var_kl"), "reward_kl"),
}


@pytest.mark.parametrize("name", list(LEARNING_RUNS))
def test_the_echo_task_still_learns(tmp_path, name):
    overrides, metric = LEARNING_RUNS[name]
    history = run(recipe(tmp_path, max_steps=60, per_device_train_batch_size=128, **overrides))
    rewards = [step["reward"] for step in history]
    first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    assert last > 2 * first + 0.05, (first, last)
    assert metric in history[-1]
