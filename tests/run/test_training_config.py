"""The training section: when micro-batches are grouped by length, the optimizer, the checkpoint
schedule (CPU)."""

from __future__ import annotations

import pytest
import torch
import yaml
from helpers.support import DEFAULT_RECIPE, recipe

from grpoflow.run.build import build_trainer, run
from grpoflow.run.checkpoint import list_checkpoints
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


@pytest.mark.parametrize(("optim", "fused"), [("adamw_torch_fused", True), ("adamw_torch", False)])
def test_optim_picks_torchs_adamw_kernel(tmp_path, optim, fused):
    trainer = build_trainer(recipe(tmp_path, optim=optim))
    try:
        assert type(trainer.optimizer) is torch.optim.AdamW
        assert bool(trainer.optimizer.defaults["fused"]) is fused
    finally:
        trainer.close()


def test_save_strategy_no_writes_no_scheduled_checkpoint(tmp_path):
    run(recipe(tmp_path / "steps", max_steps=2, save_steps=1))
    assert [path.name for path in list_checkpoints(tmp_path / "steps" / "run")] == [
        "checkpoint-1",
        "checkpoint-2",
    ]
    run(recipe(tmp_path / "no", max_steps=2, save_steps=1, save_strategy="no"))
    assert list_checkpoints(tmp_path / "no" / "run") == []
