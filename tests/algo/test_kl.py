import math

import torch

from grpoflow.algo import k3_kl


def test_k3_matches_closed_form():
    logps = torch.tensor([[-1.0, -2.0, -0.5]])
    ref_logps = torch.tensor([[-1.5, -2.0, 0.0]])
    expected = [math.exp(d) - d - 1 for d in (-0.5, 0.0, 0.5)]
    torch.testing.assert_close(k3_kl(logps, ref_logps), torch.tensor([expected]))


def test_k3_is_zero_only_where_policies_agree_and_never_negative():
    logps = torch.randn(4, 7)
    ref_logps = logps + torch.randn(4, 7)
    kl = k3_kl(logps, ref_logps)
    assert (kl >= 0).all()
    assert torch.equal(k3_kl(logps, logps), torch.zeros_like(logps))


def test_k3_gradient_is_one_minus_ratio():
    logps = torch.tensor([-1.0, -0.3], requires_grad=True)
    ref_logps = torch.tensor([-0.7, -0.9])
    k3_kl(logps, ref_logps).sum().backward()
    # d/dlogp [exp(ref - logp) - (ref - logp) - 1] = 1 - exp(ref - logp)
    torch.testing.assert_close(logps.grad, 1 - torch.exp(ref_logps - logps.detach()))
