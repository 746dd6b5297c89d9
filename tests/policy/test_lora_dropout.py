"""LoRA's dropout inside the adapter's first product (`lora_dropout.fuse_lora_dropout`): the
same outputs and gradients as dropout before the product for the same mask, the same mask again
under checkpointing, none in eval mode, and less memory kept for the backward. CPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers.live_bytes import peak_live_bytes

pytest.importorskip("peft")

from grpoflow.policy.lora import AdapterConfig, add_lora  # noqa: E402
from grpoflow.policy.lora_dropout import DroppedInputLinear  # noqa: E402
from grpoflow.policy.tiny import build_tiny_model  # noqa: E402

VOCAB = 48


def _policy(dropout: float = 0.25):
    return add_lora(build_tiny_model(VOCAB), AdapterConfig(lora_dropout=dropout, lora_rank=4))


def test_every_adapted_layer_drops_inside_its_first_product():
    policy = _policy()
    layers = [m for m in policy.modules() if type(m).__name__ == "Linear" and hasattr(m, "lora_A")]
    assert layers and all(isinstance(m.lora_A["default"], DroppedInputLinear) for m in layers)
    assert all(type(m.lora_dropout["default"]) is torch.nn.Identity for m in layers)
    assert all(m.lora_A["default"].dropout_p == 0.25 for m in layers)
    names = {name for name, _ in _policy().named_parameters()}
    assert any(name.endswith("lora_A.default.weight") for name in names)  # PEFT's names kept
    plain = _policy(dropout=0.0)
    assert not any(isinstance(m, DroppedInputLinear) for m in plain.modules())


def test_the_product_and_its_gradients_are_dropout_then_product_for_the_same_mask():
    torch.manual_seed(0)
    down = DroppedInputLinear(12, 3, bias=False)
    down.dropout_p = 0.3
    x = torch.randn(2, 5, 12, requires_grad=True)
    upstream = torch.randn(2, 5, 3)
    torch.manual_seed(7)
    out = down(x)
    grads = torch.autograd.grad(out, [x, down.weight], upstream)
    torch.manual_seed(7)
    keep = torch.empty(x.shape, dtype=torch.bool).bernoulli_(0.7)
    expected = F.linear(x * keep / 0.7, down.weight)
    expected_grads = torch.autograd.grad(expected, [x, down.weight], upstream)
    assert torch.allclose(out, expected, atol=1e-6)
    for grad, reference in zip(grads, expected_grads, strict=True):
        assert torch.allclose(grad, reference, atol=1e-5)
    assert 0.5 < keep.float().mean() < 0.9
    down.eval()
    assert torch.equal(down(x), F.linear(x, down.weight))


def test_a_checkpointed_model_recomputes_the_same_mask():
    ids = torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(1))

    def grads(checkpointing: bool):
        torch.manual_seed(11)  # the adapters' initialisation
        policy = _policy()
        if checkpointing:
            policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        policy.train()
        torch.manual_seed(3)
        policy(input_ids=ids).logits.square().mean().backward()
        return {name: p.grad for name, p in policy.named_parameters() if p.grad is not None}

    plain, checkpointed = grads(False), grads(True)
    assert plain.keys() == checkpointed.keys() and plain
    for name, grad in plain.items():
        assert torch.allclose(checkpointed[name], grad, atol=1e-6), name


def test_the_forward_keeps_less_for_the_backward_than_dropout_before_the_product():
    ids = torch.randint(0, VOCAB, (4, 64), generator=torch.Generator().manual_seed(2))
    fused = _policy()
    unfused = _policy()
    for module in unfused.modules():
        if isinstance(module, DroppedInputLinear):
            module.__class__ = DroppedInputLinear.__mro__[1]
    for module in unfused.modules():
        if hasattr(module, "lora_dropout") and "default" in module.lora_dropout:
            module.lora_dropout["default"] = torch.nn.Dropout(0.25)
    fused.train()
    unfused.train()
    kept = {}
    for name, model in (("fused", fused), ("unfused", unfused)):
        kept[name] = peak_live_bytes(lambda model=model: model(input_ids=ids).logits.sum().backward())
    assert kept["fused"] < 0.85 * kept["unfused"], kept
