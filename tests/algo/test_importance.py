"""Importance-sampling correction against closed-form values."""

from __future__ import annotations

import math

import pytest
import torch

from grpoflow.algo import SAMPLING_CORRECTION_MODES, exact_draw_weights, sampling_correction

TRAINER = torch.tensor([[-1.0, -2.0, -0.5, 0.0], [-1.0, -1.0, -1.0, -1.0]])
SAMPLER = torch.tensor([[-1.5, -1.0, -0.5, 9.0], [-1.0, -3.0, float("nan"), -1.0]])
MASK = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
GAP = torch.tensor([[0.5, -1.0, 0.0, 0.0], [0.0, 2.0, 0.0, 0.0]])
"""trainer - sampler on counted tokens; padding and NaN count as no gap."""


def test_token_truncate_clamps_each_token_ratio():
    weights, metrics = sampling_correction(TRAINER, SAMPLER, MASK, "token_truncate", 0.5, 3.0)
    expected = GAP.exp().clamp(0.5, 3.0)
    torch.testing.assert_close(weights, expected)
    counted = expected[MASK.bool()]
    assert metrics["sampling/importance_sampling_ratio/max"] == pytest.approx(3.0)
    assert metrics["sampling/importance_sampling_ratio/min"] == pytest.approx(0.5)
    assert metrics["sampling/importance_sampling_ratio/mean"] == pytest.approx(counted.mean().item())


def test_token_mask_zeroes_ratios_outside_the_range():
    weights, _ = sampling_correction(TRAINER, SAMPLER, MASK, "token_mask", 0.5, 3.0)
    expected = GAP.exp()
    expected[(expected < 0.5) | (expected > 3.0)] = 0.0
    torch.testing.assert_close(weights, expected)
    assert weights[1, 1] == 0.0 and weights[0, 1] == 0.0  # e^2 > 3, e^-1 < 0.5


def test_sequence_modes_use_the_product_of_token_ratios():
    weights, _ = sampling_correction(TRAINER, SAMPLER, MASK, "sequence_truncate", None, 3.0)
    assert weights.shape == (2, 1)
    torch.testing.assert_close(weights[:, 0], torch.tensor([math.exp(-0.5), 3.0]))
    masked, metrics = sampling_correction(TRAINER, SAMPLER, MASK, "sequence_mask", None, 3.0)
    torch.testing.assert_close(masked[:, 0], torch.tensor([math.exp(-0.5), 0.0]))
    assert metrics["sampling/importance_sampling_ratio/mean"] == pytest.approx(math.exp(-0.5) / 2)


def test_logp_difference_metrics_skip_padding_and_missing_values():
    _, metrics = sampling_correction(TRAINER, SAMPLER, MASK, "token_truncate")
    # Counted gaps: 0.5, 1.0, 0.0 | 0.0, 2.0, 0.0 (the NaN and the padded token are left out).
    assert metrics["sampling/sampling_logp_difference/mean"] == pytest.approx(3.5 / 6)
    assert metrics["sampling/sampling_logp_difference/max"] == pytest.approx(2.0)


def test_equal_log_probs_give_unit_weights_in_every_mode():
    for mode in SAMPLING_CORRECTION_MODES:
        weights, _ = sampling_correction(TRAINER, TRAINER.clone(), MASK, mode)
        assert torch.all(weights == 1.0), mode


def test_bad_mode_and_bounds_are_refused():
    with pytest.raises(ValueError, match="token_truncate"):
        sampling_correction(TRAINER, SAMPLER, MASK, "token")
    with pytest.raises(ValueError, match="clip_min"):
        sampling_correction(TRAINER, SAMPLER, MASK, "token_mask", 2.0, 1.0)


def test_exact_draws_keep_only_completions_whose_every_log_prob_is_the_trainers():
    trainer = torch.tensor([[-1.0, -2.0, -3.0], [-1.0, -2.0, -3.0], [-0.5, -0.5, 0.0], [-1.0, 0.0, 0.0]])
    sampler = trainer.clone()
    sampler[1, 2] = torch.nextafter(sampler[1, 2], torch.tensor(0.0))  # one bit off
    sampler[2, 1] = math.nan  # no engine log-prob: unverified
    sampler[3, 1] = -7.0  # padding after the completion: not read
    mask = torch.tensor([[1, 1, 1], [1, 1, 1], [1, 1, 0], [1, 0, 0]])
    weights, metrics = exact_draw_weights(trainer, sampler, mask)
    assert weights.tolist() == [[1.0], [0.0], [0.0], [1.0]]
    assert metrics["on_policy/unverified_fraction"].item() == 0.5
    assert 0 < metrics["sampling/sampling_logp_difference/max"].item() < 1e-6
