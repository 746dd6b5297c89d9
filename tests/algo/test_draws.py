"""Keyed Gumbel-max draws (CPU): the distribution they sample, the support they keep, and their
independence from how the noise is blocked."""

from __future__ import annotations

import torch
from helpers.native_fixtures import chi_square, chi_square_critical

from grpoflow.algo.draws import gumbel_draw
from grpoflow.algo.truncation import Truncation


def test_gumbel_draws_follow_the_scaled_softmax():
    torch.manual_seed(0)
    logits = torch.randn(1, 12) * 2
    draws = 60_000
    tokens, logps = gumbel_draw(logits.expand(draws, 12), torch.arange(draws), 1 / 0.7, None)
    probs = (logits[0] / 0.7).softmax(-1)
    statistic, degrees = chi_square(torch.bincount(tokens, minlength=12).float(), probs)
    assert statistic < chi_square_critical(degrees), statistic
    torch.testing.assert_close(logps, probs.log()[tokens])


def test_truncated_gumbel_draws_stay_on_the_support_and_renormalise():
    torch.manual_seed(1)
    logits = torch.randn(2000, 30)
    truncation = Truncation(top_k=5, top_p=0.9)
    thresholds = truncation.thresholds(logits)
    tokens, logps = gumbel_draw(logits, torch.arange(2000), 1.0, thresholds)
    kept = truncation.kept(logits)
    assert bool(kept.gather(1, tokens[:, None]).all())
    expected = logits.masked_fill(~kept, -torch.inf).log_softmax(-1).gather(1, tokens[:, None])[:, 0]
    torch.testing.assert_close(logps, expected)


def test_a_draw_depends_on_its_key_and_logits_only():
    torch.manual_seed(2)
    logits = torch.randn(64, 1000)
    keys = torch.randint(0, 2**32, (64,))
    whole, _ = gumbel_draw(logits, keys, 1.0, None)
    blocked, _ = gumbel_draw(logits, keys, 1.0, None, block=7)
    alone = torch.cat([gumbel_draw(logits[i : i + 1], keys[i : i + 1], 1.0, None)[0] for i in range(64)])
    assert torch.equal(whole, blocked) and torch.equal(whole, alone)
    assert not torch.equal(whole, gumbel_draw(logits, keys + 1, 1.0, None)[0])
