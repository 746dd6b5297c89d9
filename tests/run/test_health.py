"""Health checks: each fires on a synthetic run built to trip it and only then; a diverging run
stops with a checkpoint (CPU). The packaged echo run staying quiet is checked in test_trainer.py."""

from __future__ import annotations

import logging

import pytest
from helpers.support import recipe

from grpoflow.run.build import build_trainer
from grpoflow.run.failures import RunStopped
from grpoflow.run.health import CHECKS, HealthConfig, HealthMonitor

WINDOW = 5


def healthy(step: int) -> dict[str, float]:
    """A run that learns: the reward rises, entropy falls slowly, lengths hold."""
    return {
        "loss": 0.1,
        "grad_norm": 1.0,
        "reward": 0.1 + 0.01 * step,
        "kl": 0.01,
        "entropy": 2.0 - 0.01 * step,
        "frac_reward_zero_std": 0.2,
        "completions/mean_length": 100.0,
        "completions/clipped_ratio": 0.05,
        "rewards/failed_fraction": 0.0,
        "sampling/sampling_logp_difference/mean": 0.01,
        "weights/nonfinite": 0.0,
    }


def stalled(step: int) -> dict[str, float]:
    """A run whose reward never moves (otherwise healthy)."""
    return {**healthy(step), "reward": 0.1}


def play(stream, steps: int, **settings) -> list:
    monitor = HealthMonitor(HealthConfig(health_window=WINDOW, **settings))
    return [
        (step, finding.check)
        for step in range(1, steps + 1)
        for finding in monitor.update(step, stream(step))
    ]


TRIPS = {
    "nonfinite": (lambda step: {**healthy(step), "loss": float("nan")} if step == 12 else healthy(step), 12),
    "weights": (lambda step: {**healthy(step), "weights/nonfinite": 1.0} if step >= 9 else healthy(step), 9),
    "kl_spike": (lambda step: {**healthy(step), "kl": 0.9} if step == 11 else healthy(step), 11),
    "logprob_gap": (
        lambda step: (
            {**healthy(step), "sampling/sampling_logp_difference/mean": 3.0} if step >= 8 else healthy(step)
        ),
        8 + WINDOW - 1,
    ),
    "distribution_gap": (
        lambda step: {**healthy(step), "sampling/distribution_tv/max": 0.4} if step == 13 else healthy(step),
        13,
    ),
    "reward_errors": (
        lambda step: {**healthy(step), "rewards/failed_fraction": 0.8} if step >= 10 else healthy(step),
        10 + WINDOW - 1,
    ),
    "zero_spread": (
        lambda step: {**stalled(step), "frac_reward_zero_std": 1.0} if step >= 8 else stalled(step),
        8 + WINDOW - 1,
    ),
    "entropy_collapse": (
        lambda step: {**stalled(step), "entropy": 0.05} if step >= 8 else stalled(step),
        8 + WINDOW - 1,
    ),
    "length_growth": (
        lambda step: (
            {**stalled(step), "completions/mean_length": 500.0, "completions/clipped_ratio": 0.9}
            if step >= 8
            else stalled(step)
        ),
        8 + WINDOW - 1,
    ),
}


@pytest.mark.parametrize("trip", sorted(TRIPS))
def test_each_check_fires_on_the_run_built_to_trip_it_and_once(trip):
    stream, step = TRIPS[trip]
    check = "nonfinite" if trip == "weights" else trip
    fired = play(stream, 20)
    assert fired == [(step, check)], fired


def test_completions_the_updates_check_left_out_trip_the_logprob_gap_check():
    def stream(step):
        return {**healthy(step), "on_policy/unverified_fraction": 0.25} if step >= 8 else healthy(step)

    assert play(stream, 20) == [(8 + WINDOW - 1, "logprob_gap")]


def test_no_check_fires_on_a_learning_run_or_a_stalled_healthy_one():
    assert play(healthy, 60) == []
    assert play(stalled, 60) == []


def test_a_learning_run_may_stop_exploring_without_alarm():
    # A solved task: every group scores the same, entropy near zero, but the reward rose.
    def solved(step):
        metrics = healthy(step)
        if step > 10:
            metrics.update(reward=1.0, entropy=0.001, frac_reward_zero_std=1.0)
        return metrics

    assert play(solved, 40) == []


def test_every_check_can_be_turned_off():
    for trip, (stream, _) in TRIPS.items():
        check = "nonfinite" if trip == "weights" else trip
        assert play(stream, 20, **{f"health_{check}": "off"}) == [], trip
    assert set(CHECKS) == {"nonfinite" if trip == "weights" else trip for trip in TRIPS}


def test_a_warning_is_logged_once_per_streak(caplog):
    with caplog.at_level(logging.WARNING, logger="grpoflow"):
        play(TRIPS["logprob_gap"][0], 20)
    assert caplog.text.count("health check logprob_gap") == 1


def test_a_diverging_run_stops_with_a_checkpoint_naming_the_last_good_one(tmp_path):
    trainer = build_trainer(recipe(tmp_path, max_steps=8, save_steps=1, learning_rate=1e12))
    try:
        with pytest.raises(RunStopped) as stopped:
            trainer.train()
    finally:
        trainer.close()
    message = str(stopped.value)
    assert "health check nonfinite fired" in message
    assert "Checkpoint:" in message and "health_nonfinite" in message
    assert (tmp_path / "run" / f"checkpoint-{trainer.step_count}").is_dir()
