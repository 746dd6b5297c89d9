"""Fused q/k/v and gate/up products over the policy's own parameters."""

from __future__ import annotations

import tempfile

import pytest
import torch
from helpers.native_fixtures import FAMILIES, forward_logprobs, hf_greedy, tiny

from grpoflow.engines.base import SamplingParams
from grpoflow.engines.native import NativeEngine, NativeEngineConfig
from grpoflow.models.fusion import alias_rows, rows_view

PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], list(range(2, 30))]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def engine(model, fuse: bool = True) -> NativeEngine:
    config = NativeEngineConfig(max_num_seqs=4, block_size=8, num_kv_blocks=64, fuse_projections=fuse)
    return NativeEngine(model, config=config)


def tokens(outputs) -> list[list[int]]:
    return [completion.token_ids for group in outputs for completion in group]


def test_alias_rows_keeps_parameters_and_values():
    layers = [torch.nn.Linear(6, rows) for rows in (6, 2, 2)]
    params = [layer.weight for layer in layers]
    before = [p.detach().clone() for p in params]
    assert rows_view(params) is None  # separate allocations
    assert alias_rows(params)
    assert all(layer.weight is p for layer, p in zip(layers, params))  # identity kept
    assert all(torch.equal(p, b) for p, b in zip(params, before))
    fused = rows_view(params)
    assert fused is not None and fused.shape == (10, 6)
    torch.testing.assert_close(fused, torch.cat(before))
    optimizer = torch.optim.AdamW(params, lr=0.1)
    sum(layer(torch.randn(3, 6)).square().sum() for layer in layers).backward()
    optimizer.step()
    torch.testing.assert_close(rows_view(params), torch.cat([p.detach() for p in params]))
    assert not torch.equal(rows_view(params), torch.cat(before))  # the step wrote into the buffer


def test_rows_view_refuses_what_is_not_back_to_back():
    a, b = torch.randn(4, 3), torch.randn(2, 3)
    assert not alias_rows([a, torch.randn(2, 3, dtype=torch.float64)])
    assert not alias_rows([a, torch.randn(3, 2).t()])  # not contiguous
    buffer = torch.randn(8, 3)
    assert rows_view([buffer[:4], buffer[5:]]) is None  # a gap
    assert rows_view([buffer[4:], buffer[:4]]) is None  # wrong order
    assert alias_rows([a, b]) and rows_view([a, b]) is not None


@pytest.mark.parametrize("model_type", FAMILIES)
def test_fused_engine_matches_transformers_and_unfused(model_type):
    model = tiny(model_type)
    reference = [hf_greedy(model, prompt, GREEDY.max_tokens) for prompt in PROMPTS]
    fused = engine(model)
    assert all(f.qkv_weight is not None and f.gate_up_weight is not None for f in fused.family.fused)
    assert tokens(fused.generate(PROMPTS, GREEDY)) == reference
    assert tokens(engine(tiny(model_type), fuse=False).generate(PROMPTS, GREEDY)) == reference


def test_moved_parameters_run_fused_copies_for_one_call_and_stay_fresh():
    # As FSDP's gathered weights are: each projection in storage of its own.
    model = tiny("qwen2")
    native = engine(model)
    native.generate(PROMPTS, GREEDY)
    attention, mlp = model.model.layers[0].self_attn, model.model.layers[1].mlp
    with torch.no_grad():
        attention.k_proj.weight.data = attention.k_proj.weight.data * 3  # new storage
        mlp.up_proj.weight.data = mlp.up_proj.weight.data.clone()
    during = []
    copy_fused = native.family.copy_fused

    def watched() -> bool:
        made = copy_fused()
        during.append([(f.qkv_weight is not None, f.gate_up_weight is not None) for f in native.family.fused])
        torch.testing.assert_close(
            native.family.fused[1].gate_up_weight, torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])
        )
        return made

    native.family.copy_fused = watched
    expected = [hf_greedy(model, prompt, GREEDY.max_tokens) for prompt in PROMPTS]
    assert tokens(native.generate(PROMPTS, GREEDY)) == expected
    assert during == [[(True, True)] * len(model.model.layers)]  # every product fused in the call
    assert native.family.fused[0].qkv_weight is None and native.family.fused[1].gate_up_weight is None
    before = [c.logprobs for group in native.generate(PROMPTS, GREEDY) for c in group]
    with torch.no_grad():  # new values in place: the next call copies them again
        attention.k_proj.weight.mul_(-2)
        mlp.up_proj.weight.mul_(-2)
    outputs = native.generate(PROMPTS, GREEDY)
    for prompt, group in zip(PROMPTS, outputs):
        (completion,) = group
        want = forward_logprobs(model, prompt, completion.token_ids, 1.0)
        torch.testing.assert_close(torch.tensor(completion.logprobs), torch.tensor(want), atol=1e-4, rtol=0)
    assert [c.logprobs for group in outputs for c in group] != before


def test_unfused_engine_makes_no_copies():
    model = tiny("qwen2")
    native = engine(model, fuse=False)
    assert tokens(native.generate(PROMPTS, GREEDY)) == [
        hf_greedy(model, prompt, GREEDY.max_tokens) for prompt in PROMPTS
    ]
    assert not any(f.copies for f in native.family.fused)
    assert all(f.qkv_weight is None and f.gate_up_weight is None for f in native.family.fused)


def test_fused_parameters_save_and_load():
    model = tiny("qwen2")
    engine(model)
    with tempfile.TemporaryDirectory() as directory:
        model.save_pretrained(directory)
        loaded = type(model).from_pretrained(directory)
    for name, tensor in loaded.state_dict().items():
        torch.testing.assert_close(tensor, model.state_dict()[name], rtol=0, atol=0)
