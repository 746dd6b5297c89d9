"""LoRA on a mixture-of-experts model's fused experts (PEFT's `target_parameters`) on the native
engine's family path, on the CPU: greedy tokens and log-probs against PEFT's own forward, with the
reference loop and the grouped products, the prefix cache, adapters trained in place between
calls, and adapters switched off."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers.native_fixtures import (
    expert_lora,
    forward_logprobs,
    hf_greedy,
    one_thread,  # noqa: F401 (a fixture)
    tiny_moe,
)

from grpoflow.engines.base import SamplingParams
from grpoflow.engines.native import NativeEngine, NativeEngineConfig
from grpoflow.kernels.ops import TorchOps
from grpoflow.models.moe import grouped_experts, reference_experts, route
from grpoflow.models.moe_adapters import expert_adapters

pytest.importorskip("peft")

PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], list(range(2, 30))]


@pytest.fixture(scope="module")
def policy():
    return expert_lora(tiny_moe())


def engine(policy, **kwargs) -> NativeEngine:
    config = dict(max_num_seqs=8, block_size=4, num_kv_blocks=256)
    config.update(kwargs)
    native = NativeEngine(policy.get_base_model(), config=NativeEngineConfig(**config))
    assert native.path == "family"
    return native


def greedy(max_tokens: int = 16, n: int = 1) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, n=n, ignore_eos=True)


def test_expert_adapters_change_the_output_as_peft_adds_them(policy):
    block = policy.get_base_model().model.layers[0].mlp
    x = torch.randn(37, 64, generator=torch.Generator().manual_seed(1))
    weights, chosen = route(x, block.gate.weight, 2, True)
    experts = block.experts.get_base_layer()
    adapters = expert_adapters(block.experts)
    assert len(adapters.gate_up) == len(adapters.down) == 1
    args = (x, experts.gate_up_proj, experts.down_proj, chosen, weights, TorchOps.silu_mul)
    with torch.no_grad():
        expected = block(x[None])[0]  # PEFT's forward: the experts' weights merged on the fly
        plain = reference_experts(*args)
        reference, grouped = reference_experts(*args, adapters), grouped_experts(*args, adapters)
    assert (plain - expected).abs().max() > 0.1
    torch.testing.assert_close(reference, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grouped, reference, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("grouped", [False, True], ids=["reference", "grouped"])
def test_greedy_tokens_match_peft(policy, grouped):
    native = engine(policy)
    for mlp in native.family.sparse.values():
        mlp.grouped = grouped
        assert mlp.adapters.gate_up and mlp.adapters.down
    base = hf_greedy(tiny_moe(), PROMPTS[2], 16)
    outputs = native.generate(PROMPTS, greedy(n=2))
    for prompt, completions in zip(PROMPTS, outputs):
        reference = hf_greedy(policy, prompt, 16)
        assert [completion.token_ids for completion in completions] == [reference, reference]
    assert outputs[2][0].token_ids != base  # the adapters matter


def test_logprobs_match_peft(policy):
    params = SamplingParams(temperature=0.7, max_tokens=12, n=2, ignore_eos=True, seed=1)
    for prompt, completions in zip(PROMPTS, engine(policy).generate(PROMPTS, params)):
        for completion in completions:
            expected = forward_logprobs(policy, prompt, completion.token_ids, 0.7)
            np.testing.assert_allclose(completion.logprobs, expected, atol=1e-4)


def test_the_engine_follows_adapters_trained_in_place_through_the_prefix_cache():
    """An in-place write to the experts' B (an optimizer step) reaches the next call: the cached
    prefix is dropped and the copies are written again; then the prefix cache serves the same
    tokens as a fresh prefill."""
    policy = expert_lora(tiny_moe(), seed=4)
    shared = list(range(2, 30))
    prompts = [shared + [40, 41], shared + [42]]
    native = engine(policy, record_routing=True)
    before = native.generate(prompts, greedy(8))
    shared_within_a_call = native.stats.prefill.num_cached_tokens  # the second prompt reads the first's
    with torch.no_grad():
        for name, parameter in policy.named_parameters():
            if "experts" in name and "lora_B" in name:
                parameter.mul_(-1.5)
    after = native.generate(prompts, greedy(8))
    assert native.stats.prefill.num_cached_tokens == shared_within_a_call
    again = native.generate(prompts, greedy(8))
    assert native.stats.prefill.num_cached_tokens >= shared_within_a_call + 24
    for prompt, got_after, got_again in zip(prompts, after, again):
        assert got_after[0].token_ids == got_again[0].token_ids == hf_greedy(policy, prompt, 8)
        assert torch.equal(got_after[0].routed_experts, got_again[0].routed_experts)
    assert [c[0].token_ids for c in before] != [c[0].token_ids for c in after]


def test_adapters_switched_off_generate_the_base_model(policy):
    native = engine(policy)
    with policy.disable_adapter():
        outputs = native.generate(PROMPTS[2:], greedy())
        assert all(not mlp.adapters.terms for mlp in native.family.sparse.values())
    assert outputs[0][0].token_ids == hf_greedy(tiny_moe(), PROMPTS[2], 16)
    assert native.generate(PROMPTS[2:], greedy())[0][0].token_ids == hf_greedy(policy, PROMPTS[2], 16)
