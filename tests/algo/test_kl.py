import math

import pytest
import torch

from grpoflow.algo import k3_kl, kl_estimate, sequence_kl


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


def closed_form(name: str, d: float) -> float:
    """The estimators of the module docstring, with `d = ref - logp`."""
    if name == "k1":
        return -d
    if name == "k2":
        return d * d / 2
    if name == "k3":
        return math.exp(d) - d - 1
    d = min(max(d, -20.0), 20.0)
    return min(max(math.exp(d) - d - 1, -10.0), 10.0)


@pytest.mark.parametrize("name", ["k1", "k2", "k3", "low_var_kl"])
def test_estimators_match_their_closed_forms(name):
    logps = torch.tensor([[-1.0, -2.0, -0.5, -30.0, -0.1]], dtype=torch.float64)
    ref_logps = torch.tensor([[-1.5, -2.0, 0.0, -0.1, -25.0]], dtype=torch.float64)
    expected = [closed_form(name, r - p) for p, r in zip(logps[0].tolist(), ref_logps[0].tolist())]
    torch.testing.assert_close(
        kl_estimate(logps, ref_logps, name), torch.tensor([expected], dtype=torch.float64)
    )


def test_low_var_kl_is_k3_clipped():
    logps = torch.tensor([[-1.0, -0.2, -12.0]])
    ref_logps = torch.tensor([[-0.5, -0.9, -0.1]])
    low_var = kl_estimate(logps, ref_logps, "low_var_kl")
    torch.testing.assert_close(low_var[:, :2], k3_kl(logps, ref_logps)[:, :2])
    assert k3_kl(logps, ref_logps)[0, 2] > 10 and low_var[0, 2] == 10


def test_sequence_kl_sums_the_masked_tokens():
    logps = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -0.4, -9.0]])
    ref_logps = torch.tensor([[-1.5, -1.0, 0.0], [-0.3, -0.2, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    torch.testing.assert_close(sequence_kl(logps, ref_logps, mask, "k1"), torch.tensor([-1.0, -0.2]))


def test_unknown_estimator_names_the_known_ones():
    with pytest.raises(ValueError, match=r"\['k1', 'k2', 'k3', 'low_var_kl'\]"):
        kl_estimate(torch.zeros(1, 1), torch.zeros(1, 1), "k4")
