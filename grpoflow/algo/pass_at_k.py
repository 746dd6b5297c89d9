"""Evaluation statistics over groups of n samples per prompt: pass@k, avg@n and maj@k.

- pass@k, the chance that at least one of k samples drawn without replacement from a prompt's n is
  correct, with the unbiased estimator of Chen et al. (2021): 1 - C(n - c, k) / C(n, k) for c
  correct samples, computed as a product so that it neither overflows nor loses precision.
- avg@n: the mean correctness of all n samples (pass@1 is its expectation).
- maj@k: whether the answer most of a prompt's first k samples give (ties broken by the answer
  given first) is correct; samples with no answer do not vote, and a prompt with no answer at all
  counts as wrong. Samples are drawn independently, so the first k are a fair draw of k.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Sequence

import torch
from torch import Tensor


def k_values(n: int) -> list[int]:
    """The k reported for n samples per prompt: 1, 2, 4, ... up to n, and n itself.

    >>> k_values(6)
    [1, 2, 4, 6]
    """
    if n < 1:
        raise ValueError(f"k_values needs n >= 1 samples per prompt, got {n}")
    ks = [1 << power for power in range(n.bit_length()) if 1 << power <= n]
    return ks if ks[-1] == n else [*ks, n]


def pass_at_k(correct: Tensor, k: int) -> Tensor:
    """Unbiased pass@k per prompt.

    Args:
        correct: `(num_prompts, n)` bool, whether each sample is correct.
        k: samples drawn, 1 <= k <= n.

    Returns:
        `(num_prompts,)` float64 in [0, 1].

    Example: n = 4 with 1 correct gives pass@1 = 0.25 and pass@2 = 1 - C(3, 2) / C(4, 2) = 0.5.
    """
    if correct.dim() != 2:
        raise ValueError(f"pass_at_k expects (num_prompts, n) correctness, got shape {tuple(correct.shape)}")
    n = correct.shape[1]
    if not 1 <= k <= n:
        raise ValueError(f"pass@{k} needs 1 <= k <= n = {n} samples per prompt")
    wrong = (~correct.bool()).sum(dim=1).to(torch.float64)
    # C(n - c, k) / C(n, k) = prod_{i=0}^{k-1} (n - c - i) / (n - i); zero once n - c < k.
    steps = torch.arange(k, dtype=torch.float64)
    ratios = ((wrong[:, None] - steps) / (n - steps)).clamp(min=0)
    return 1 - ratios.prod(dim=1)


def majority_correct(answers: Sequence[Sequence[Hashable | None]], correct: Tensor, k: int) -> Tensor:
    """maj@k per prompt: whether the majority answer of the first k samples is correct.

    Args:
        answers: per prompt, each sample's extracted answer (None: none found).
        correct: `(num_prompts, n)` bool, whether each sample is correct.
        k: samples voting, 1 <= k <= n.

    Returns:
        `(num_prompts,)` float64, 1.0 where the voted answer's first sample is correct.
    """
    results = []
    for row, given in enumerate(answers):
        votes = Counter(answer for answer in given[:k] if answer is not None)
        if not votes:
            results.append(0.0)
            continue
        top = max(votes.values())
        winner = next(answer for answer in given[:k] if answer is not None and votes[answer] == top)
        results.append(float(correct[row, list(given).index(winner)]))
    return torch.tensor(results, dtype=torch.float64)
