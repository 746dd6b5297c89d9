"""The post-sync check catches an engine that did not take the trained weights."""

from __future__ import annotations

import copy

import pytest
import torch

from grpoflow.engines.hf import HFEngine
from grpoflow.policy.placement import Placement
from grpoflow.policy.tiny import build_char_tokenizer, build_tiny_model
from grpoflow.run.sync_check import SyncCheck, WeightSyncCheckError


class CopyingEngine(HFEngine):
    """An engine with its own copy of the weights, like vLLM or a server; `stale` drops updates."""

    shares_policy_weights = False

    def __init__(self, model, tokenizer, *, stale: bool) -> None:
        super().__init__(copy.deepcopy(model), tokenizer)
        self.stale = stale

    def update_weights(self, weights, version: int) -> None:
        if self.stale:
            self.policy_version = version
            return
        super().update_weights(((name, tensor.detach().clone()) for name, tensor in weights), version)


@pytest.fixture
def setup():
    tokenizer = build_char_tokenizer()
    model = build_tiny_model(len(tokenizer))
    probe = tokenizer("echo c:")["input_ids"]
    return model, tokenizer, SyncCheck(probe, tolerance=0.5)


def train_a_lot(model: torch.nn.Module) -> None:
    """Move the weights far, as many optimizer steps would."""
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.5)


def test_an_engine_that_took_the_weights_passes(setup):
    model, tokenizer, check = setup
    engine = CopyingEngine(model, tokenizer, stale=False)
    train_a_lot(model)
    engine.update_weights(model.named_parameters(), 1)
    metrics = check(engine, Placement.local(model), step=1)
    assert metrics["sync/check_logprob_gap"] < 1e-4


def test_an_engine_left_on_old_weights_stops_the_run(setup):
    model, tokenizer, check = setup
    engine = CopyingEngine(model, tokenizer, stale=True)
    train_a_lot(model)
    engine.update_weights(model.named_parameters(), 7)
    with pytest.raises(WeightSyncCheckError, match="weight sync of step 7, the CopyingEngine engine"):
        check(engine, Placement.local(model), step=7)
    assert model.training  # the check restores the trainer's mode


def test_an_empty_probe_is_refused():
    with pytest.raises(ValueError, match="non-empty probe prompt"):
        SyncCheck([], tolerance=0.5)
