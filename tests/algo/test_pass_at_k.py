"""pass@k, maj@k and the reported k, against closed forms and brute-force enumeration (CPU)."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from grpoflow.algo.pass_at_k import k_values, majority_correct, pass_at_k


def brute_force_pass_at_k(correct: list[bool], k: int) -> float:
    """The share of the k-subsets of the samples holding a correct one."""
    subsets = list(itertools.combinations(correct, k))
    return sum(any(subset) for subset in subsets) / len(subsets)


@pytest.mark.parametrize("n", [1, 2, 5, 8])
def test_pass_at_k_equals_enumerating_every_subset(n):
    generator = torch.Generator().manual_seed(n)
    correct = torch.rand((12, n), generator=generator) < 0.3
    for k in range(1, n + 1):
        expected = [brute_force_pass_at_k(row.tolist(), k) for row in correct]
        torch.testing.assert_close(pass_at_k(correct, k), torch.tensor(expected, dtype=torch.float64))


def test_pass_at_k_matches_the_closed_form_for_large_n():
    n, c, k = 200, 7, 50
    correct = torch.zeros((1, n), dtype=torch.bool)
    correct[0, :c] = True
    expected = 1 - math.comb(n - c, k) / math.comb(n, k)
    assert pass_at_k(correct, k).item() == pytest.approx(expected, rel=1e-12)
    assert pass_at_k(correct, 1).item() == pytest.approx(c / n)


def test_pass_at_k_refuses_k_outside_the_samples():
    with pytest.raises(ValueError, match="1 <= k <= n = 4"):
        pass_at_k(torch.zeros((2, 4), dtype=torch.bool), 5)


def test_k_values_are_powers_of_two_and_n():
    assert k_values(1) == [1]
    assert k_values(8) == [1, 2, 4, 8]
    assert k_values(12) == [1, 2, 4, 8, 12]


def test_majority_vote_over_the_first_k_samples():
    answers = [
        ["12", "7", "12", "7", "7"],  # k=3: 12 wins (2 of 3); k=5: 7 wins (3 of 5)
        [None, "3", None, "4", "4"],  # k=2: only 3 votes; k=4: a tie 3/4 goes to 3, given first
        [None, None, None, None, None],  # nothing to vote on: wrong
    ]
    correct = torch.tensor(
        [[True, False, True, False, False], [False, True, False, False, False], [False] * 5]
    )
    assert majority_correct(answers, correct, 3).tolist() == [1.0, 1.0, 0.0]
    assert majority_correct(answers, correct, 5).tolist() == [0.0, 0.0, 0.0]
    assert majority_correct(answers, correct, 4).tolist() == [1.0, 1.0, 0.0]
