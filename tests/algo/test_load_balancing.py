"""The routers' load-balancing loss against Switch Transformer's formula written out with one-hot
assignments, and against transformers' own function for each MoE family replay covers (CPU)."""

from __future__ import annotations

import importlib

import pytest
import torch

from grpoflow.algo.load_balancing import load_balancing_loss

EXPERTS, TOP_K, LAYERS, BATCH, SEQ = 8, 2, 3, 2, 5


def one_hot_reference(logits, num_experts, top_k, mask):
    """num_experts * sum_e f_e P_e over the stacked layers, with the (rows, top_k, experts) one-hot."""
    stacked = torch.cat(logits).float()
    probabilities = torch.softmax(stacked, dim=-1)
    assigned = torch.nn.functional.one_hot(torch.topk(probabilities, top_k).indices, num_experts).float()
    weights = torch.ones(stacked.shape[0]) if mask is None else mask.reshape(-1).float().repeat(len(logits))
    fraction = (assigned * weights[:, None, None]).sum((0, 1)) / weights.sum()
    mean_probability = (probabilities * weights[:, None]).sum(0) / weights.sum()
    return num_experts * (fraction * mean_probability).sum()


@pytest.fixture
def logits():
    torch.manual_seed(0)
    return [torch.randn(BATCH * SEQ, EXPERTS, requires_grad=True) for _ in range(LAYERS)]


@pytest.mark.parametrize("masked", [False, True])
def test_the_loss_is_switch_transformers_and_its_gradient_reaches_every_layer(logits, masked):
    mask = torch.tensor([[0, 1, 1, 1, 1], [1, 1, 1, 0, 0]]) if masked else None
    loss = load_balancing_loss(logits, EXPERTS, TOP_K, mask)
    torch.testing.assert_close(loss, one_hot_reference(logits, EXPERTS, TOP_K, mask))
    loss.backward()
    assert all(layer.grad is not None and layer.grad.abs().sum() > 0 for layer in logits)
    if masked:  # a token the mask drops has no gradient
        assert all(layer.grad[0].abs().sum() == 0 for layer in logits)


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe", "mixtral", "olmoe"])
def test_the_loss_equals_transformers_own_for_each_family(logits, family):
    module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    mask = torch.tensor([[1, 1, 1, 1, 0], [0, 1, 1, 1, 1]])
    for attention_mask in (None, mask):
        expected = module.load_balancing_loss_func(tuple(logits), EXPERTS, TOP_K, attention_mask)
        torch.testing.assert_close(load_balancing_loss(logits, EXPERTS, TOP_K, attention_mask), expected)


def test_no_layers_is_an_error_naming_the_logits():
    with pytest.raises(ValueError, match="router logits"):
        load_balancing_loss([], EXPERTS, TOP_K)
