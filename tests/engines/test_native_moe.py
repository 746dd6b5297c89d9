"""Mixture-of-experts (Qwen3-MoE) on the native engine's family path, on the CPU: greedy tokens and
log-probs against transformers, the grouped expert products against the reference loop, the prefix
cache, recorded routing against transformers' router, and the generic path's one log line."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from helpers.native_fixtures import (
    VOCAB_SIZE,
    forward_logprobs,
    hf_greedy,
    one_thread,  # noqa: F401 (a fixture)
    tiny_moe,
)
from transformers import GPT2Config, GPT2LMHeadModel

from grpoflow.engines.base import SamplingParams
from grpoflow.engines.native import NativeEngine, NativeEngineConfig
from grpoflow.kernels.ops import TorchOps
from grpoflow.models.moe import grouped_experts, reference_experts, route

PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], list(range(2, 30))]
GENERIC_LINE = "runs on the native engine's generic path"


@pytest.fixture(scope="module", params=[True, False], ids=["norm_topk", "raw_topk"])
def model(request):
    return tiny_moe(request.param)


def engine(model, **kwargs) -> NativeEngine:
    config = dict(max_num_seqs=8, block_size=4, num_kv_blocks=256)
    config.update(kwargs)
    return NativeEngine(model, config=NativeEngineConfig(**config))


def greedy(max_tokens: int = 24, n: int = 2) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, n=n, ignore_eos=True)


def hf_routing(model, ids: list[int]) -> torch.Tensor:
    """(positions, sparse layers, k): the experts transformers' routers pick in one forward."""
    chosen, hooks = [], []
    for layer in model.model.layers:
        if hasattr(layer.mlp, "gate"):
            hook = layer.mlp.gate.register_forward_hook(lambda module, args, out: chosen.append(out[2]))
            hooks.append(hook)
    with torch.no_grad():
        model(torch.tensor([ids]))
    for hook in hooks:
        hook.remove()
    return torch.stack(chosen, dim=1)


@pytest.mark.parametrize("grouped", [False, True], ids=["reference", "grouped"])
def test_greedy_tokens_match_transformers(model, grouped):
    """The reference loop, and the grouped products that run on CUDA (`torch._grouped_mm` also
    runs on the CPU)."""
    native = engine(model)
    assert native.path == "family"
    for mlp in native.family.sparse.values():
        mlp.grouped = grouped
    for prompt, completions in zip(PROMPTS, native.generate(PROMPTS, greedy())):
        reference = hf_greedy(model, prompt, 24)
        assert [completion.token_ids for completion in completions] == [reference, reference]


def test_logprobs_match_a_forward_pass(model):
    params = SamplingParams(temperature=0.7, max_tokens=16, n=2, ignore_eos=True, seed=1)
    for prompt, completions in zip(PROMPTS, engine(model).generate(PROMPTS, params)):
        for completion in completions:
            expected = forward_logprobs(model, prompt, completion.token_ids, 0.7)
            np.testing.assert_allclose(completion.logprobs, expected, atol=1e-4)


def test_grouped_products_equal_the_reference_and_transformers(model):
    torch.manual_seed(1)
    block = model.model.layers[0].mlp
    x = torch.randn(37, 64)
    weights, chosen = route(x, block.gate.weight, 2, model.config.norm_topk_prob)
    _, hf_weights, hf_chosen = block.gate(x)
    assert torch.equal(chosen, hf_chosen) and torch.equal(weights, hf_weights)
    experts = block.experts
    args = (x, experts.gate_up_proj, experts.down_proj, chosen, weights, TorchOps.silu_mul)
    with torch.no_grad():
        reference, grouped, expected = reference_experts(*args), grouped_experts(*args), block(x[None])[0]
    torch.testing.assert_close(reference, expected, rtol=0, atol=0)
    torch.testing.assert_close(grouped, reference, rtol=1e-5, atol=1e-6)


def test_recorded_routing_is_what_transformers_routes(model):
    native = engine(model, record_routing=True)
    outputs = native.generate(PROMPTS, greedy(12))
    for prompt, completions in zip(PROMPTS, outputs):
        for completion in completions:
            routed = completion.routed_experts
            assert routed.shape == (len(prompt) + 12, 3, 2) and routed.device.type == "cpu"
            assert (routed[-1] == -1).all()  # the last token was sampled, never fed
            expected = hf_routing(model, prompt + completion.token_ids)
            assert torch.equal(routed[:-1].long(), expected[:-1])


def test_the_prefix_cache_serves_the_same_tokens_and_routing(model):
    shared = list(range(2, 30))
    prompts = [shared + [40, 41], shared + [42]]
    plain = engine(model, record_routing=True, enable_prefix_caching=False).generate(prompts, greedy(8))
    cached = engine(model, record_routing=True)
    cached.generate([shared], greedy(2, n=1))  # its blocks are cached
    outputs = cached.generate(prompts, greedy(8))
    assert cached.stats.prefill.num_cached_tokens >= 2 * 24
    for got, want in zip(outputs, plain):
        for got_one, want_one in zip(got, want):
            assert got_one.token_ids == want_one.token_ids
            assert torch.equal(got_one.routed_experts, want_one.routed_experts)


def test_routing_survives_preemption(model):
    """Few rows and a small cache: sequences are preempted, prefilled again, and keep their routing."""
    want = engine(model, record_routing=True).generate(PROMPTS, greedy(24))
    small = engine(model, record_routing=True, max_num_seqs=3, num_kv_blocks=24)
    got = small.generate(PROMPTS, greedy(24))
    assert small.stats.extra["preemptions"] > 0
    for got_prompt, want_prompt in zip(got, want):
        for got_one, want_one in zip(got_prompt, want_prompt):
            assert got_one.token_ids == want_one.token_ids
            assert torch.equal(got_one.routed_experts, want_one.routed_experts)


def test_an_unsupported_expert_layout_runs_generic_with_one_line(caplog):
    """Experts stored transposed ((E, H, 2I) and (E, I, H)): transformers reads them, the family
    path does not, so the model runs on the generic path and generates as transformers does."""
    model = tiny_moe()
    reference = hf_greedy(model, PROMPTS[0], 6)
    with torch.no_grad():
        for layer in model.model.layers:
            experts = getattr(layer.mlp, "experts", None)
            if experts is not None:
                experts.gate_up_proj = torch.nn.Parameter(experts.gate_up_proj.transpose(1, 2).contiguous())
                experts.down_proj = torch.nn.Parameter(experts.down_proj.transpose(1, 2).contiguous())
                experts.is_transposed = True
    with caplog.at_level(logging.INFO, logger="grpoflow.engines.native"):
        native = engine(model)
        outputs = native.generate(PROMPTS[:1], greedy(6, n=2))
    lines = [record.getMessage() for record in caplog.records if GENERIC_LINE in record.getMessage()]
    assert native.path == "generic" and len(lines) == 1
    assert (
        lines[0].startswith("qwen3_moe runs on")
        and "gemma3_text; the reason here: an expert layout" in lines[0]
    )
    assert [completion.token_ids for completion in outputs[0]] == [reference, reference]


def test_other_architectures_log_the_generic_path_without_a_reason(caplog):
    model = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=VOCAB_SIZE)).eval()
    with caplog.at_level(logging.INFO, logger="grpoflow.engines.native"):
        NativeEngine(model, config=NativeEngineConfig(max_num_seqs=2))
    (line,) = [record.getMessage() for record in caplog.records if GENERIC_LINE in record.getMessage()]
    assert line.startswith("gpt2 runs on") and line.endswith("qwen3_moe, gemma3_text")


def test_adapters_on_attention_stay_on_the_family_path_and_on_the_router_go_generic(caplog):
    peft = pytest.importorskip("peft")
    attention = peft.get_peft_model(tiny_moe(), peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        for name, parameter in attention.named_parameters():
            if "lora_B" in name:
                parameter.normal_(std=0.3)
    native = engine(attention.get_base_model())
    assert native.path == "family"
    outputs = native.generate(PROMPTS, greedy(12))
    merged = attention.merge_and_unload().eval()
    for prompt, completions in zip(PROMPTS, outputs):
        assert completions[0].token_ids == hf_greedy(merged, prompt, 12)
    router = peft.LoraConfig(
        r=4, lora_dropout=0.0, target_modules=["q_proj"], target_parameters=["gate.weight"]
    )
    with caplog.at_level(logging.INFO, logger="grpoflow.engines.native"):
        native = engine(peft.get_peft_model(tiny_moe(), router).get_base_model())
    assert native.path == "generic"
    (line,) = [record.getMessage() for record in caplog.records if GENERIC_LINE in record.getMessage()]
    assert "LoRA adapters on the router" in line


def test_record_routing_needs_experts_on_the_family_path():
    dense = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=VOCAB_SIZE)).eval()
    with pytest.raises(ValueError, match="record_routing needs a mixture-of-experts model"):
        engine(dense, record_routing=True)
    with pytest.raises(ValueError, match=r"generic path \(force_generic is set\)"):
        engine(tiny_moe(), record_routing=True, force_generic=True)


def test_an_abandoned_prompt_keeps_the_routing_of_what_it_generated(model):
    want = engine(model, record_routing=True).generate(PROMPTS, greedy(40))
    calls = []

    def abandoned() -> list[int]:
        calls.append(None)
        return [1] if len(calls) > 6 else []

    got = engine(model, record_routing=True).generate(PROMPTS, greedy(40), abandoned=abandoned)
    assert all(completion.finish_reason == "abort" for completion in got[1])
    for got_prompt, want_prompt, prompt in zip(got, want, PROMPTS):
        for got_one, want_one in zip(got_prompt, want_prompt):
            length = len(prompt) + len(got_one.token_ids)
            assert got_one.routed_experts.shape[0] == length and (got_one.routed_experts[-1] == -1).all()
            assert torch.equal(got_one.routed_experts[:-1], want_one.routed_experts[: length - 1])
