"""The update phase's importance-sampling correction against the engine's log-probs."""

from __future__ import annotations

import math

import pytest
import torch

from grpoflow.policy.placement import Placement
from grpoflow.policy.tiny import build_tiny_model
from grpoflow.run.algorithm import AlgorithmConfig
from grpoflow.run.rollout import RolloutBatch
from grpoflow.run.update import (
    ImportanceCorrection,
    UpdateSettings,
    batch_logprobs,
    update_policy,
)

VOCAB = 40


def _settings(**overrides) -> UpdateSettings:
    return UpdateSettings(
        **{"algorithm": AlgorithmConfig(), "max_completion_length": 6, "max_grad_norm": 0.0, **overrides}
    )


def _batch(model, settings) -> RolloutBatch:
    generator = torch.Generator().manual_seed(0)
    batch = RolloutBatch(
        prompt_ids=torch.randint(0, VOCAB, (4, 5), generator=generator),
        prompt_mask=torch.ones(4, 5, dtype=torch.long),
        completion_ids=torch.randint(0, VOCAB, (4, 6), generator=generator),
        completion_mask=torch.ones(4, 6, dtype=torch.long),
        sampling_logps=torch.zeros(4, 6),
        truncated=torch.zeros(4, dtype=torch.bool),
    )
    with torch.no_grad():
        batch.sampling_logps = batch_logprobs(Placement.local(model), batch, settings)[0]
    return batch


def _train(correction: ImportanceCorrection | None, shift: float) -> tuple[dict, dict[str, float]]:
    """Parameters after one update on a fixed batch whose engine log-probs are the policy's minus
    `shift` nats per token, and the update's metrics."""
    model = build_tiny_model(VOCAB, seed=0)
    settings = _settings(micro_batch_size=2, temperature=1.0, sampling_correction=correction)
    batch = _batch(model, settings)
    batch.sampling_logps = batch.sampling_logps - shift
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    metrics = update_policy(
        Placement.local(model), optimizer, scheduler, batch, torch.tensor([1.0, -1.0, 0.5, -0.5]), settings
    )
    return {name: p.detach() - before[name] for name, p in model.named_parameters()}, metrics


def test_matching_engine_log_probs_change_nothing():
    plain, _ = _train(None, 0.0)
    corrected, metrics = _train(ImportanceCorrection(vllm_importance_sampling_mode="token_truncate"), 0.0)
    for name in plain:
        torch.testing.assert_close(corrected[name], plain[name], rtol=1e-5, atol=1e-7)
    assert metrics["sampling/importance_sampling_ratio/mean"] == 1.0


def test_token_ratios_scale_the_update_and_masked_ones_drop_it():
    plain, _ = _train(None, 0.0)
    # The engine gave every token log(2) nats less: every ratio is 2 (SGD: the step doubles).
    doubled, metrics = _train(
        ImportanceCorrection(vllm_importance_sampling_mode="token_truncate"), math.log(2)
    )
    for name in plain:
        torch.testing.assert_close(doubled[name], 2 * plain[name], rtol=1e-4, atol=1e-6)
    assert metrics["sampling/importance_sampling_ratio/max"] == pytest.approx(2.0, rel=1e-5)
    # A sequence ratio of 2^6 is outside the range: every sequence is masked, nothing moves.
    masked, _ = _train(ImportanceCorrection(vllm_importance_sampling_mode="sequence_mask"), math.log(2))
    assert all(torch.count_nonzero(delta) == 0 for delta in masked.values())


def test_batches_without_left_padding_skip_the_mask_and_score_the_same():
    model = build_tiny_model(VOCAB, seed=0)
    settings = _settings(micro_batch_size=4, temperature=0.8)
    batch = _batch(model, settings)
    batch.completion_mask[1, 3:] = 0  # right padding: hidden by the causal mask alone
    batch.completion_mask[2, 1:] = 0
    batch.left_padded = False
    unmasked = batch_logprobs(Placement.local(model), batch, settings)[0]
    batch.left_padded = True
    masked = batch_logprobs(Placement.local(model), batch, settings)[0]
    mask = batch.completion_mask.bool()
    torch.testing.assert_close(unmasked[mask], masked[mask], rtol=1e-5, atol=1e-5)


class CountingPlacement(Placement):
    """A replicated placement that counts the forward passes and uses run through it."""

    __slots__ = ("forwards", "uses")

    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__(module=module, device=torch.device("cpu"))
        self.forwards, self.uses = 0, 0

    def sharded_forward(self, function):
        self.forwards += 1
        return super().sharded_forward(function)

    def in_use(self):
        self.uses += 1
        return super().in_use()


def test_every_forward_pass_runs_through_the_placements_it_is_given():
    model, ref_model = build_tiny_model(VOCAB, seed=0), build_tiny_model(VOCAB, seed=1)
    settings = _settings(
        micro_batch_size=2, temperature=1.0, algorithm=AlgorithmConfig(beta=0.1, num_iterations=2)
    )
    batch = _batch(model, settings)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    policy, reference = CountingPlacement(model), CountingPlacement(ref_model)
    update_policy(
        policy, optimizer, scheduler, batch, torch.tensor([1.0, -1.0, 0.5, -0.5]), settings, reference
    )
    # Two micro-batches: old log-probs once, then the loss's forward in each of two iterations.
    assert (policy.forwards, policy.uses) == (2 + 2 * 2, 0)
    assert (reference.forwards, reference.uses) == (2, 1)
