"""LoRA adapters kept in float32 multiply in the activations' dtype (CPU)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

peft = pytest.importorskip("peft")

from grpoflow.policy.lora import AdapterConfig, add_lora  # noqa: E402
from grpoflow.policy.lora_precision import InputDtypeLinear, compute_in_input_dtype  # noqa: E402
from grpoflow.policy.tiny import build_char_tokenizer, build_tiny_model  # noqa: E402


def tiny(dtype: torch.dtype) -> torch.nn.Module:
    return build_tiny_model(len(build_char_tokenizer()), seed=0).to(dtype)


def adapted(dtype: torch.dtype, *, ours: bool = True) -> torch.nn.Module:
    """A tiny model with non-zero LoRA adapters: through `add_lora`, or PEFT's own."""
    config = AdapterConfig(lora_dropout=0.0, target_modules=["q_proj", "down_proj"])
    if ours:
        model = add_lora(tiny(dtype), config)
    else:
        lora = peft.LoraConfig(r=8, lora_alpha=32, lora_dropout=0.0, target_modules=["q_proj", "down_proj"])
        model = peft.get_peft_model(tiny(dtype), lora)
    with torch.no_grad(), torch.random.fork_rng():
        torch.manual_seed(1)
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(std=0.2)
    return model


def a_layer(model):
    return model.base_model.model.model.layers[0].mlp.down_proj


def test_bf16_adapters_stay_float32_and_multiply_in_bf16():
    model = adapted(torch.bfloat16)
    layer = a_layer(model)
    A, B = layer.lora_A["default"], layer.lora_B["default"]
    assert isinstance(A, InputDtypeLinear) and A.weight.dtype == torch.float32
    x = torch.randn(5, layer.in_features, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    seen = []
    B.register_forward_hook(lambda module, args, out: seen.append(out.dtype))
    got = layer(x)
    want = (
        layer.base_layer(x)
        + F.linear(F.linear(x, A.weight.bfloat16()), B.weight.bfloat16()) * layer.scaling["default"]
    )
    assert seen == [torch.bfloat16] and got.dtype == torch.bfloat16
    assert torch.equal(got, want)


def test_peft_alone_runs_the_branch_in_float32():
    """What `compute_in_input_dtype` changes: PEFT's own layer upcasts to float32."""
    layer = a_layer(adapted(torch.bfloat16, ours=False))
    seen = []
    layer.lora_B["default"].register_forward_hook(lambda module, args, out: seen.append(out.dtype))
    layer(torch.randn(2, layer.in_features).to(torch.bfloat16))
    assert seen == [torch.float32]


def test_gradients_reach_the_float32_weights_as_autocast_gives_them():
    model = adapted(torch.bfloat16)
    layer = a_layer(model)
    A, B = layer.lora_A["default"], layer.lora_B["default"]
    x = torch.randn(4, layer.in_features, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    layer(x).float().square().sum().backward()
    a32 = A.weight.detach().clone().requires_grad_()
    b32 = B.weight.detach().clone().requires_grad_()
    with torch.no_grad():
        base = layer.base_layer(x)
    out = base + F.linear(F.linear(x, a32.bfloat16()), b32.bfloat16()) * layer.scaling["default"]
    out.float().square().sum().backward()
    assert A.weight.grad.dtype == torch.float32 and B.weight.grad.dtype == torch.float32
    assert torch.equal(A.weight.grad, a32.grad) and torch.equal(B.weight.grad, b32.grad)


def test_a_float32_model_computes_exactly_as_peft_does():
    ours, theirs = adapted(torch.float32), adapted(torch.float32, ours=False)
    theirs.load_state_dict(ours.state_dict())
    ids = torch.randint(3, 30, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.equal(ours(input_ids=ids).logits, theirs(input_ids=ids).logits)


def test_layers_whose_adapters_are_not_linear_keep_peft_casting():
    model = build_tiny_model(len(build_char_tokenizer()), seed=0, tie_word_embeddings=False)
    lora = peft.LoraConfig(r=4, target_modules=["embed_tokens", "q_proj"])
    model = peft.get_peft_model(model.to(torch.bfloat16), lora)
    assert compute_in_input_dtype(model) == 2 * len(model.base_model.model.model.layers)
    embedding = model.base_model.model.model.embed_tokens
    assert embedding.cast_input_dtype_enabled
    assert not model.base_model.model.model.layers[0].self_attn.q_proj.cast_input_dtype_enabled
    assert compute_in_input_dtype(model) == 0  # a second call changes nothing
