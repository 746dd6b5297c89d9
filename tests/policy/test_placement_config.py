"""PlacementConfig's checks and how an unset FSDP layout option reads (CPU, no processes)."""

from __future__ import annotations

import dataclasses

import pytest

from grpoflow import options
from grpoflow.policy.placement_config import PlacementConfig
from grpoflow.run.config import GRPOConfig


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"fsdp_offload_params": True}, "fsdp_offload_params needs fsdp=true"),
        ({"fsdp": True, "offload_model": True}, "offload_model moves a replicated model"),
        ({"fsdp": True, "offload_optimizer": True}, "use fsdp_offload_params=true"),
        ({"fsdp": True, "fsdp_mixed_precision": "fp8"}, "fsdp_mixed_precision must be one of"),
    ],
)
def test_a_placement_config_refuses_impossible_layouts(overrides, message):
    with pytest.raises(ValueError, match=message):
        PlacementConfig(**overrides)
    fields = {field.name for field in dataclasses.fields(PlacementConfig)}
    owners = options.flat_fields(GRPOConfig)
    assert all(owners[name].path == ("placement", name) for name in fields)


@pytest.mark.parametrize(("value", "applied"), [(None, True), (True, True), (False, False)])
def test_an_unset_fsdp_layout_option_applies_as_the_layout_of_least_memory(value, applied):
    config = PlacementConfig(fsdp=True, fsdp_reshard_after_forward=value, fsdp_reduce_every_micro_batch=value)
    assert config.reshards_after_forward is applied
    assert config.reduces_every_micro_batch is applied
