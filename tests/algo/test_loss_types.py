"""The loss-type registry: a decorated surrogate is a loss type of `policy_loss` and
`micro_batch_scale`; taken and unknown names are refused with the known ones named."""

from __future__ import annotations

import pytest
import torch
from helpers.plugin_loss import ScaledSettings, scaled_loss

from grpoflow.algo import (
    LOSS_TYPES,
    BatchTotals,
    ClipSettings,
    LossSettings,
    loss_type,
    micro_batch_scale,
    policy_loss,
    register_loss,
)
from grpoflow.algo.surrogates import clipped

BUILT_IN = ["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo"]


@pytest.fixture
def plugin():
    with scaled_loss() as name:
        yield name


def inputs():
    generator = torch.Generator().manual_seed(0)
    logps = -torch.rand(3, 4, generator=generator, dtype=torch.float64)
    old_logps = logps + 0.3 * torch.randn(3, 4, generator=generator, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0]])
    return logps, old_logps, torch.tensor([1.0, -0.5, 2.0], dtype=torch.float64), mask


def test_the_built_in_loss_types_are_registered_in_the_order_options_list_them():
    assert list(LOSS_TYPES) == BUILT_IN
    assert loss_type("vespo").weighs_sampler_mismatch is False
    assert {name: loss_type(name).settings.__name__ for name in ("dapo", "cispo", "sapo", "vespo")} == {
        "dapo": "ClipSettings",
        "cispo": "ClipSettings",
        "sapo": "SapoSettings",
        "vespo": "VespoSettings",
    }


def test_a_registered_loss_type_is_used_by_policy_loss_with_its_own_settings(plugin):
    totals = BatchTotals(num_items_in_batch=10)
    dapo, dapo_metrics = policy_loss(*inputs(), LossSettings(loss_type="dapo"), totals)
    scaled, metrics = policy_loss(*inputs(), LossSettings(loss_type=plugin), totals)
    torch.testing.assert_close(scaled, 2 * dapo)
    assert metrics.keys() == dapo_metrics.keys()
    tripled, _ = policy_loss(
        *inputs(), LossSettings(loss_type=plugin, surrogate_settings=ScaledSettings(factor=3.0)), totals
    )
    torch.testing.assert_close(tripled, 3 * dapo)
    assert micro_batch_scale(plugin, 4) == 1.0  # reduced as dapo: divided by the batch's tokens


def test_a_name_taken_twice_is_refused_naming_the_taken_ones(plugin):
    with pytest.raises(ValueError, match=rf"'{plugin}' is already registered.*'cispo', 'dapo'"):
        register_loss(plugin, reduction="grpo", settings=ClipSettings)(clipped)
    with pytest.raises(ValueError, match="'dapo' is already registered"):
        register_loss("dapo", reduction="dapo", settings=ClipSettings)(lambda inputs, settings: None)


def test_unknown_names_are_refused_naming_the_known_ones(plugin):
    known = r"\['bnpo', 'cispo', 'dapo', 'dr_grpo', 'grpo', 'luspo', 'sapo', 'scaled_dapo', 'vespo'\]"
    with pytest.raises(ValueError, match=f"Unknown loss_type 'ppo'; known: {known}"):
        loss_type("ppo")
    with pytest.raises(ValueError, match=f"known: {known}"):
        LossSettings(loss_type="ppo")
    with pytest.raises(ValueError, match=r"Unknown loss reduction 'mean'; known: \['bnpo', 'dapo'"):
        register_loss("mean_loss", reduction="mean", settings=ClipSettings)
    assert "mean_loss" not in LOSS_TYPES


def test_settings_of_another_loss_type_are_refused():
    with pytest.raises(TypeError, match="loss_type 'sapo' takes SapoSettings, got ClipSettings"):
        LossSettings(loss_type="sapo", surrogate_settings=ClipSettings())
