"""kernels.ops' grouped linear against a loop of `F.linear` over the experts (CPU; torch's grouped
product runs there in float32 too)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from grpoflow.kernels.ops import grouped_linear

COUNTS = [4, 0, 12]
"""Rows per expert: the second expert gets none."""


def reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    pieces, start = [], 0
    for expert, count in enumerate(COUNTS):
        pieces.append(F.linear(x[start : start + count], weight[expert]))
        start += count
    return torch.cat(pieces)


@pytest.mark.parametrize("use_grouped_mm", [False, True])
def test_grouped_linear_gives_the_loops_rows_and_gradients(use_grouped_mm):
    torch.manual_seed(0)
    x, weight = torch.randn(16, 8, requires_grad=True), torch.randn(3, 12, 8, requires_grad=True)
    ends = torch.tensor(COUNTS).cumsum(0).to(torch.int32)
    grad = torch.randn(16, 12)
    expected = reference(x, weight)
    want_x, want_w = torch.autograd.grad(expected, (x, weight), grad)
    got = grouped_linear(x, weight, ends, use_grouped_mm)
    torch.testing.assert_close(got, expected)
    got_x, got_w = torch.autograd.grad(got, (x, weight), grad)
    torch.testing.assert_close(got_x, want_x)
    torch.testing.assert_close(got_w, want_w)
    assert (got_w[1] == 0).all()  # the expert without rows


def test_frozen_experts_get_no_weight_gradient():
    x, weight = torch.randn(16, 8, requires_grad=True), torch.randn(3, 12, 8)
    ends = torch.tensor(COUNTS).cumsum(0).to(torch.int32)
    grouped_linear(x, weight, ends, use_grouped_mm=True).sum().backward()
    torch.testing.assert_close(x.grad, torch.autograd.grad(reference(x, weight).sum(), x)[0])
    assert weight.grad is None
