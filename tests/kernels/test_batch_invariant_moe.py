"""The batch-invariant mixture-of-experts layer: the grouped expert product's rows are
`matmul_forward`'s bit for bit whatever the grouping (CPU paths; the Triton kernel under Triton's
interpreter in float32; bfloat16 on the GPU, tests marked `gpu`), its gradients torch's, the
routing row-invariant with ties to the lower expert, and a Qwen3-MoE policy's sparse blocks on the
kernels close to transformers' own, their parameters trained under their own names."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from helpers.native_fixtures import tiny_moe

pytest.importorskip("triton")

from grpoflow.kernels import batch_invariant as bi  # noqa: E402
from grpoflow.kernels import batch_invariant_moe as moe  # noqa: E402
from grpoflow.policy.batch_invariant import BatchInvariantKernels  # noqa: E402

GROUPINGS = """
import torch
from grpoflow.kernels import batch_invariant as bi
from grpoflow.kernels import batch_invariant_moe as moe

torch.manual_seed(0)
weight = torch.randn(5, 72, 80)
x = torch.randn(40, 80)
for counts in ([8, 8, 8, 8, 8], [0, 40, 0, 0, 0], [1, 0, 3, 0, 1], [0, 0, 0, 0, 7], [13, 2, 0, 20, 5]):
    ends = torch.tensor(counts).cumsum(0).to(torch.int32)
    rows = x[: int(ends[-1])]
    out = moe.grouped_matmul_forward(rows, weight, ends)
    start = 0
    for expert, end in enumerate(ends.tolist()):
        for row in range(start, end):
            assert torch.equal(out[row], bi.matmul_forward(rows[row : row + 1], weight[expert])[0]), counts
        start = end
print("ok")
"""


def _interpret(source: str, interpreter: bool = True) -> None:
    """Run `source` in a fresh process (the interpreter is chosen when Triton is imported)."""
    env = {**os.environ, "TRITON_INTERPRET": "1" if interpreter else "0"}
    result = subprocess.run(
        [sys.executable, "-c", source], env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-3000:]


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA machine runs the compiled kernel (gpu tests)")
def test_grouped_rows_are_matmul_rows_whatever_the_grouping_interpreted():
    """Even groups, one expert taking every row, empty experts first, last and between."""
    _interpret(GROUPINGS)


def test_grouped_rows_are_matmul_rows_whatever_the_grouping_on_the_cpu_paths():
    _interpret(GROUPINGS, interpreter=False)


def _ends(counts: list[int]) -> torch.Tensor:
    return torch.tensor(counts).cumsum(0).to(torch.int32)


@pytest.mark.parametrize("use_grouped_mm", [False, True])
def test_the_grouped_products_gradients_are_torchs(use_grouped_mm):
    torch.manual_seed(0)
    x, weight, ends = torch.randn(16, 8), torch.randn(3, 12, 8), _ends([4, 0, 12])
    grad = torch.randn(16, 12)
    expected_x, expected_w = torch.zeros_like(x), torch.zeros_like(weight)
    for expert, (start, end) in enumerate([(0, 4), (4, 4), (4, 16)]):
        expected_x[start:end] = grad[start:end] @ weight[expert]
        expected_w[expert] = grad[start:end].T @ x[start:end]
    grad_x, grad_w = moe.grouped_grads(grad, x, weight, ends, use_grouped_mm)
    torch.testing.assert_close(grad_x, expected_x)
    torch.testing.assert_close(grad_w, expected_w)
    x.requires_grad_(), weight.requires_grad_()
    (moe.grouped_matmul(x, weight, ends) * grad).sum().backward()
    torch.testing.assert_close(x.grad, expected_x)
    torch.testing.assert_close(weight.grad, expected_w)


def test_routing_keeps_each_row_and_breaks_ties_to_the_lower_expert():
    torch.manual_seed(0)
    logits = (torch.randn(30, 8) * 3).to(torch.bfloat16)
    logits[3] = torch.tensor([1.0, 2.0, 0.5, 2.0, 2.0, 0.0, -1.0, 1.0])
    for normalize in (True, False):
        weights, chosen = moe.route(logits, 2, normalize)
        assert chosen[3].tolist() == [1, 3]
        for rows in (1, 7):
            again, chosen_again = moe.route(logits[-rows:], 2, normalize)
            assert torch.equal(again, weights[-rows:]) and torch.equal(chosen_again, chosen[-rows:])
        probs = logits.float().softmax(-1)
        top, experts = probs.topk(2, dim=-1)
        top = top / top.sum(-1, keepdim=True) if normalize else top
        stock = torch.cat([experts[:3], experts[4:]]), torch.cat([top[:3], top[4:]])
        assert torch.equal(torch.cat([chosen[:3], chosen[4:]]), stock[0])
        torch.testing.assert_close(torch.cat([weights[:3], weights[4:]]).float(), stock[1], atol=1e-2, rtol=0)


def test_the_trainers_sparse_blocks_follow_transformers_and_train_their_own_parameters():
    """float32: outputs and gradients close to the stock blocks' (the same experts chosen), every
    parameter under its own name; removing the kernels leaves the stock forward."""
    model = tiny_moe().train()
    ids = torch.tensor([[3, 4, 5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 15, 16, 17, 18]])

    def loss_and_grads():
        model.zero_grad()
        logits = model(input_ids=ids).logits
        logits.float().logsumexp(-1).sum().backward()
        return logits.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}

    stock, stock_grads = loss_and_grads()
    kernels = BatchInvariantKernels.install(model)
    ours, our_grads = loss_and_grads()
    torch.testing.assert_close(ours, stock, atol=1e-4, rtol=1e-4)
    assert our_grads.keys() == stock_grads.keys()
    assert any(".experts.gate_up_proj" in name for name in our_grads)
    for name, grad in our_grads.items():
        torch.testing.assert_close(grad, stock_grads[name], atol=1e-4, rtol=1e-3, msg=name)
        assert "experts" not in name or grad.abs().sum() > 0
    kernels.remove()
    assert torch.equal(loss_and_grads()[0], stock)


def test_bad_grouped_inputs_are_refused_with_the_fix():
    with pytest.raises(ValueError, match="one dtype"):
        moe.grouped_matmul_forward(torch.randn(4, 8), torch.randn(2, 6, 8).bfloat16(), _ends([2, 2]))
    with pytest.raises(ValueError, match="weight \\(E, N, K\\)"):
        moe.grouped_matmul_forward(torch.randn(4, 8), torch.randn(2, 6, 5), _ends([2, 2]))
    with pytest.raises(ValueError, match="int32"):
        moe.grouped_matmul_forward(torch.randn(4, 8), torch.randn(2, 6, 8), torch.tensor([2, 4]))


NEEDS_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
EXPERT_SHAPES = {"gate_up": (128, 1536, 2048), "down": (128, 2048, 768)}
"""Qwen3-30B-A3B's experts: (experts, out, in)."""


@pytest.mark.gpu
@NEEDS_CUDA
@pytest.mark.parametrize("name", list(EXPERT_SHAPES))
@pytest.mark.parametrize("tokens", [1, 7, 512, 4096])
def test_grouped_rows_are_matmul_rows_across_groupings_gpu(name, tokens):
    """bfloat16, 8 experts a token: the rows routed at random (uneven groups, empty experts) and
    all to one expert give every row as `matmul_forward` computes it alone, and as the full
    forward's grouping computes it."""
    torch.manual_seed(0)
    experts, out_features, in_features = EXPERT_SHAPES[name]
    weight = torch.randn(experts, out_features, in_features, device="cuda", dtype=torch.bfloat16)
    weight = weight * in_features**-0.5
    x = torch.randn(tokens * 8, in_features, device="cuda", dtype=torch.bfloat16)
    routed = torch.randint(0, experts, (tokens * 8,), device="cuda").sort().values
    ends = torch.searchsorted(routed, torch.arange(1, experts + 1, device="cuda"), out_int32=True)
    out = moe.grouped_matmul_forward(x, weight, ends)
    lone = torch.zeros(experts, dtype=torch.int32, device="cuda") + x.shape[0]
    lone[:5] = 0  # every row to expert 5
    single = moe.grouped_matmul_forward(x, weight, lone)
    reference = torch.nn.functional.linear(x.float(), weight[5].float())
    torch.testing.assert_close(single.float(), reference, atol=3e-2, rtol=2e-2)
    assert torch.equal(single, bi.matmul_forward(x, weight[5]))
    for row in torch.randint(0, x.shape[0], (16,)).tolist():
        expert = int(routed[row])
        assert torch.equal(out[row], bi.matmul_forward(x[row : row + 1], weight[expert])[0]), row
        assert torch.equal(single[row], bi.matmul_forward(x[row : row + 1], weight[5])[0]), row


@pytest.mark.gpu
@NEEDS_CUDA
def test_the_grouped_products_gradients_by_grouped_mm_are_the_loops_gpu():
    """bfloat16 on CUDA, the backward's `torch._grouped_mm` against the loop over the experts."""
    torch.manual_seed(0)
    experts, out_features, in_features = EXPERT_SHAPES["down"]
    weight = torch.randn(experts, out_features, in_features, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(4096, in_features, device="cuda", dtype=torch.bfloat16)
    grad = torch.randn(4096, out_features, device="cuda", dtype=torch.bfloat16)
    routed = torch.randint(0, experts, (4096,), device="cuda").sort().values
    ends = torch.searchsorted(routed, torch.arange(1, experts + 1, device="cuda"), out_int32=True)
    grouped = moe.grouped_grads(grad, x, weight, ends, use_grouped_mm=True)
    for got, expected in zip(grouped, moe.grouped_grads(grad, x, weight, ends, use_grouped_mm=False)):
        torch.testing.assert_close(got.float(), expected.float(), atol=0.5, rtol=2e-2)
