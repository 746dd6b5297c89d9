"""Adapters sent to the native engine as tensors (`grpoflow.transport.adapters`): the rank limit,
and the adapter-free path again once the base weights arrive without them."""

from __future__ import annotations

import pytest
import torch
from helpers.native_fixtures import tiny

from grpoflow.engines.base import SamplingParams
from grpoflow.engines.native import NativeEngine, NativeEngineConfig

Q, V = "model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.v_proj"
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def engine(model, **kwargs) -> NativeEngine:
    return NativeEngine(model, config=NativeEngineConfig(max_num_seqs=4, num_kv_blocks=64, **kwargs))


def adapter(model, module: str, rank: int) -> list[tuple[str, torch.Tensor]]:
    linear = model.get_submodule(module)
    generator = torch.Generator().manual_seed(rank)
    down = 0.1 * torch.randn(rank, linear.in_features, generator=generator)
    up = 0.1 * torch.randn(linear.out_features, rank, generator=generator)
    return [(f"{module}.lora_A.weight", down), (f"{module}.lora_B.weight", up)]


def base(model) -> list[tuple[str, torch.Tensor]]:
    return [(name, p.detach().clone()) for name, p in model.named_parameters()]


def adapted_projections(native: NativeEngine) -> list[str]:
    family = native.family
    return [name for name, module in family.projection_names.items() if family.loaded.get(name)]


def assert_adapter_free(native: NativeEngine) -> None:
    family = native.family
    assert family.loaded == {} and family.copies == {}
    groups = family.adapter_groups
    assert all(not projection.terms for group in groups for projection in group)
    assert all(fused.qkv_down is None and fused.gate_up_down is None for fused in family.fused)


def test_a_base_reload_without_adapters_returns_to_the_adapter_free_path():
    model = tiny()
    native = engine(model)
    prompt = [[5, 6, 7, 8]]
    plain = native.generate(prompt, GREEDY)[0][0].token_ids
    native.update_weights([*adapter(model, Q, 32), *adapter(model, V, 32)], 1)
    assert adapted_projections(native) == [Q, V]
    native.generate(prompt, GREEDY)
    native.update_weights(base(model), 2)  # the base again, no adapter: the weights arrived merged
    assert_adapter_free(native)
    assert native.generate(prompt, GREEDY)[0][0].token_ids == plain


def test_a_layer_keeps_its_adapter_unless_its_base_arrives_without_one():
    model = tiny()
    native = engine(model)
    native.update_weights([*adapter(model, Q, 4), *adapter(model, V, 4)], 1)
    others = [(name, tensor) for name, tensor in base(model) if not name.startswith(Q)]
    native.update_weights([*others, *adapter(model, Q, 4)], 2)
    assert adapted_projections(native) == [Q]  # v's base arrived alone; q's came with its adapter
    norm = [(name, tensor) for name, tensor in base(model) if name == "model.norm.weight"]
    native.update_weights(norm, 3)  # modules_to_save alone: the adapters stay
    assert adapted_projections(native) == [Q]


def test_an_adapter_above_max_lora_rank_is_refused_naming_the_option():
    model = tiny()
    assert NativeEngineConfig().max_lora_rank == 64
    native = engine(model, max_lora_rank=8)
    assert native.capabilities.max_adapter_rank == 8
    with pytest.raises(ValueError, match=r"rank 16, above max_lora_rank 8"):
        native.update_weights(adapter(model, Q, 16), 1)
    assert native.family.loaded == {}
    native.update_weights(adapter(model, Q, 8), 1)
    assert adapted_projections(native) == [Q]
    with pytest.raises(ValueError, match="max_lora_rank must be >= 1"):
        NativeEngineConfig(max_lora_rank=0)
