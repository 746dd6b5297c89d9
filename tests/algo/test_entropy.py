import math

import pytest
import torch

from grpoflow.algo import AdaptiveEntropy, entropy_bonus, high_entropy_mask


def test_high_entropy_mask_keeps_the_top_quantile_of_the_masked_tokens():
    entropies = torch.tensor([[0.1, 0.5, 0.9, 0.3], [2.0, 0.2, 9.0, 9.0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    # masked entropies 0.1 0.5 0.9 0.3 2.0 0.2: the 0.5 quantile is 0.4
    kept = high_entropy_mask(entropies, mask, 0.5)
    torch.testing.assert_close(kept, torch.tensor([[0.0, 1.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0]]))
    torch.testing.assert_close(high_entropy_mask(entropies, mask, 1.0), mask.float())
    assert high_entropy_mask(entropies, mask, 0.0).sum() == 1  # the single highest
    assert high_entropy_mask(entropies, torch.zeros_like(mask), 0.5).sum() == 0


def test_entropy_bonus_is_the_token_mean():
    entropies = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]], requires_grad=True)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    bonus = entropy_bonus(entropies, mask)
    bonus.backward()
    assert bonus.item() == pytest.approx(7 / 3)
    torch.testing.assert_close(entropies.grad, mask / 3.0)


def test_static_coefficient_never_moves():
    control = AdaptiveEntropy(coef=0.05)
    control.step(0.01)
    assert control.enabled and control.applied_coef() == control.coef == 0.05
    assert not AdaptiveEntropy(coef=0.0).enabled


def test_adaptive_coefficient_rises_below_target_and_applies_only_there():
    control = AdaptiveEntropy(coef=0.0, adaptive=True, target=1.0, delta=0.3, coef_min=0.0, coef_max=0.5)
    assert control.enabled and control.last_entropy == math.inf
    assert control.applied_coef() == 0.0  # no step measured yet
    control.step(0.5)  # below target: up by delta
    assert control.coef == pytest.approx(0.3) and control.applied_coef() == pytest.approx(0.3)
    control.step(0.8)  # still below: up, capped at coef_max
    assert control.coef == pytest.approx(0.5)
    control.step(2.0)  # above target: down by delta, and no bonus next step
    assert control.coef == pytest.approx(0.2) and control.applied_coef() == 0.0
    control.step(3.0)
    control.step(3.0)
    assert control.coef == 0.0  # floored at coef_min
