"""The Triton log-softmax kernels of `_LinearLogProb` against its eager float32 path (GPU)."""

from __future__ import annotations

import pytest
import torch

from grpoflow.algo import logprobs
from grpoflow.algo.logprobs import token_logprobs_from_hidden

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def _run(fused: bool, hidden, weight, targets, temperature, monkeypatch):
    monkeypatch.setattr(logprobs, "FUSED_LOG_SOFTMAX", fused)
    hidden = hidden.detach().clone().requires_grad_(True)
    weight = weight.detach().clone().requires_grad_(True)
    log_probs, entropy = token_logprobs_from_hidden(
        hidden, weight, targets, temperature=temperature, chunk_size=96, compute_entropy=True
    )
    upstream = torch.linspace(-1.0, 1.0, log_probs.numel(), device=hidden.device).view_as(log_probs)
    (log_probs * upstream).sum().backward()
    return log_probs.detach(), entropy, hidden.grad, weight.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_fused_matches_eager(dtype, temperature, monkeypatch):
    generator = torch.Generator(device="cuda").manual_seed(0)
    vocab = 10_007  # not a multiple of the kernel's block
    hidden = torch.randn(2, 150, 64, device="cuda", generator=generator).to(dtype)
    weight = (torch.randn(vocab, 64, device="cuda", generator=generator) * 0.3).to(dtype)
    targets = torch.randint(0, vocab, (2, 150), device="cuda", generator=generator)
    fused = _run(True, hidden, weight, targets, temperature, monkeypatch)
    eager = _run(False, hidden, weight, targets, temperature, monkeypatch)
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(fused[0], eager[0], atol=tolerance, rtol=tolerance)
    torch.testing.assert_close(fused[1], eager[1], atol=tolerance, rtol=tolerance)
    for fused_grad, eager_grad in zip(fused[2:], eager[2:]):
        scale = eager_grad.float().abs().max()
        error = (fused_grad.float() - eager_grad.float()).abs().max() / scale
        assert error < (1e-4 if dtype == torch.float32 else 2e-2), error


def test_fused_extreme_logits(monkeypatch):
    """Large logits: the online softmax must not overflow where the eager path does not."""
    hidden = torch.full((1, 4, 8), 30.0, device="cuda")
    weight = torch.randn(5000, 8, device="cuda")
    targets = torch.tensor([[0, 1, 2, 4999]], device="cuda")
    fused = _run(True, hidden, weight, targets, 1.0, monkeypatch)
    eager = _run(False, hidden, weight, targets, 1.0, monkeypatch)
    assert torch.isfinite(fused[0]).all() and torch.isfinite(fused[2]).all()
    torch.testing.assert_close(fused[0], eager[0], atol=1e-3, rtol=1e-4)


def test_entropy_gradient_through_the_fused_forward_matches_full_logits(monkeypatch):
    monkeypatch.setattr(logprobs, "FUSED_LOG_SOFTMAX", True)
    generator = torch.Generator(device="cuda").manual_seed(0)
    vocab, temperature = 10_007, 0.7
    hidden = torch.randn(2, 150, 64, device="cuda", generator=generator).requires_grad_(True)
    weight = (torch.randn(vocab, 64, device="cuda", generator=generator) * 0.3).requires_grad_(True)
    targets = torch.randint(0, vocab, (2, 150), device="cuda", generator=generator)
    up_logp = torch.linspace(-1.0, 1.0, 300, device="cuda").view(2, 150)
    up_entropy = torch.linspace(1.0, -0.5, 300, device="cuda").view(2, 150)

    log_probs = torch.log_softmax((hidden @ weight.t()).float() / temperature, dim=-1)
    entropy = -(log_probs.exp() * log_probs).sum(-1)
    chosen = log_probs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    expected = torch.autograd.grad((chosen * up_logp).sum() + (entropy * up_entropy).sum(), [hidden, weight])

    log_probs, entropy = token_logprobs_from_hidden(
        hidden, weight, targets, temperature, chunk_size=96, compute_entropy=True, entropy_grad=True
    )
    grads = torch.autograd.grad((log_probs * up_logp).sum() + (entropy * up_entropy).sum(), [hidden, weight])
    for grad, expected_grad in zip(grads, expected):
        torch.testing.assert_close(grad, expected_grad, atol=1e-3, rtol=1e-3)
