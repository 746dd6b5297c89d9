"""The training section: when micro-batches are grouped by length (CPU)."""

from __future__ import annotations

import pytest
import yaml
from helpers.support import DEFAULT_RECIPE

from grpoflow.run.config import load_config


@pytest.mark.parametrize(
    ("overrides", "grouped"),
    [
        ({}, True),
        ({"loss_type": "grpo"}, True),
        ({"loss_type": "bnpo"}, False),
        ({"top_entropy_quantile": 0.2}, False),
        ({"loss_type": "bnpo", "group_by_length": True}, True),
        ({"group_by_length": False}, False),
    ],
)
def test_micro_batches_are_grouped_by_length_unless_that_changes_the_loss(overrides, grouped):
    config = load_config(None, {**yaml.safe_load(DEFAULT_RECIPE.read_text()), **overrides})
    assert config.update_settings(copies_weights=False).group_by_length is grouped
