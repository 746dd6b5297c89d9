"""Truncated sampling replayed on the trainer's logits: thresholds, supports and log-probs against
closed forms (CPU)."""

from __future__ import annotations

import math

import pytest
import torch

from grpoflow.algo.draws import keyed_draw
from grpoflow.algo.logprobs import token_logprobs_from_hidden
from grpoflow.algo.truncation import Truncation, truncated_scores

# One row, probabilities 0.5, 0.25, 0.125, 0.0625, 0.0625 (logits are their logs).
PROBS = torch.tensor([[0.5, 0.25, 0.125, 0.0625, 0.0625]])
LOGITS = PROBS.log()


def kept_tokens(truncation: Truncation) -> list[int]:
    return truncation.kept(LOGITS)[0].nonzero().flatten().tolist()


def test_each_filter_keeps_the_tokens_its_definition_names():
    assert Truncation().kept(LOGITS) is None and not Truncation(top_k=-1).active
    assert kept_tokens(Truncation(top_k=2)) == [0, 1]
    # top-p 0.7: 0.5 alone is short of 0.7, 0.5 + 0.25 reaches it
    assert kept_tokens(Truncation(top_p=0.7)) == [0, 1]
    assert kept_tokens(Truncation(top_p=0.5)) == [0]
    # min-p 0.2: tokens of at least 0.2 * 0.5 = 0.1
    assert kept_tokens(Truncation(min_p=0.2)) == [0, 1, 2]
    # top-p over the top-k survivors renormalised: top 3 = 0.5, 0.25, 0.125 of 0.875; 0.5/0.875 < 0.6
    assert kept_tokens(Truncation(top_k=3, top_p=0.6)) == [0, 1]
    # ties at the threshold all stay in
    assert kept_tokens(Truncation(top_k=4)) == [0, 1, 2, 3, 4]


def test_a_target_outside_the_support_is_kept():
    kept = Truncation(top_k=1).kept(LOGITS, torch.tensor([3]))
    assert kept[0].nonzero().flatten().tolist() == [0, 3]


def test_log_probs_under_truncation_are_renormalised_over_the_kept_mass():
    hidden = torch.eye(5)[None]  # (1, 5, 5): position t's logits are row t of the head
    head = LOGITS.expand(5, 5).t().contiguous()  # logits = hidden @ head.T = LOGITS at every position
    targets = torch.tensor([[0, 1, 0, 1, 1]])
    truncation = Truncation(top_p=0.7)  # keeps tokens 0 and 1, mass 0.75
    logps, entropy = token_logprobs_from_hidden(
        hidden, head, targets, compute_entropy=True, truncation=truncation
    )
    expected = (PROBS[0, targets[0]] / 0.75).log()
    torch.testing.assert_close(logps[0], expected)
    p = torch.tensor([0.5, 0.25]) / 0.75
    torch.testing.assert_close(entropy[0], torch.full((5,), float(-(p * p.log()).sum())))
    full, _ = token_logprobs_from_hidden(hidden, head, targets)
    torch.testing.assert_close(logps - full, torch.full_like(full, -math.log(0.75)))


def test_the_gradient_under_truncation_is_the_renormalised_softmax_on_the_support():
    torch.manual_seed(0)
    hidden = torch.randn(2, 3, 8, requires_grad=True)
    head = torch.nn.Linear(8, 11, bias=False)
    targets = torch.randint(0, 11, (2, 3))
    truncation = Truncation(top_k=4, top_p=0.9)
    logps, _ = token_logprobs_from_hidden(hidden, head, targets, temperature=0.7, truncation=truncation)
    logps.sum().backward()
    ours = (hidden.grad.clone(), head.weight.grad.clone())
    hidden.grad, head.weight.grad = None, None
    scaled = head(hidden).float() / 0.7
    flat = truncated_scores(scaled.reshape(-1, 11), truncation, targets.reshape(-1))
    reference = flat.log_softmax(-1).gather(1, targets.reshape(-1, 1)).sum()
    reference.backward()
    torch.testing.assert_close(ours[0], hidden.grad)
    torch.testing.assert_close(ours[1], head.weight.grad)


@pytest.mark.parametrize("truncation", [Truncation(top_k=3), Truncation(top_p=0.8), Truncation(min_p=0.1)])
def test_the_keyed_draw_reports_what_the_trainer_replays(truncation):
    torch.manual_seed(1)
    logits = torch.randn(64, 50) * 2
    keys = torch.randint(0, 2**32, (64,))
    scaled = logits / 0.8
    tokens, logps = keyed_draw(logits, keys, 1 / 0.8, False, truncation.thresholds(scaled))
    assert bool(truncation.kept(scaled).gather(1, tokens[:, None]).all())
    replayed = truncated_scores(scaled, truncation, tokens).log_softmax(-1).gather(1, tokens[:, None])[:, 0]
    torch.testing.assert_close(logps, replayed)
