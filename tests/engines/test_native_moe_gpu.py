"""Mixture-of-experts on the native engine's CUDA path: the grouped expert products
(`torch._grouped_mm`, bfloat16) against the reference loop, decode steps replayed from CUDA
graphs against eager ones (tokens and recorded routing), greedy decoding against transformers;
LoRA on the experts the same ways, and against PEFT's forward."""

from __future__ import annotations

import pytest
import torch
from helpers.native_fixtures import expert_lora, forward_logprobs, hf_greedy, tiny_moe

from grpoflow.engines.base import SamplingParams
from grpoflow.engines.native import NativeEngine, NativeEngineConfig
from grpoflow.kernels.ops import TorchOps, grouped_mm_runs
from grpoflow.models.moe import grouped_experts, reference_experts, route
from grpoflow.models.moe_adapters import expert_adapters

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
PROMPTS = [list(range(3, 40)), [5, 6, 7] * 12, [9, 10, 11]]


def test_grouped_products_equal_the_reference_in_bfloat16():
    if not grouped_mm_runs(torch.device("cuda"), torch.bfloat16):
        pytest.skip("torch._grouped_mm does not run on this GPU")
    torch.manual_seed(0)
    experts, hidden, inter, tokens = 16, 256, 128, 300
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    router = torch.randn(experts, hidden, device="cuda", dtype=torch.bfloat16)
    gate_up = torch.randn(experts, 2 * inter, hidden, device="cuda", dtype=torch.bfloat16) / 16
    down = torch.randn(experts, hidden, inter, device="cuda", dtype=torch.bfloat16) / 16
    weights, chosen = route(x, router, 4, True)
    args = (x, gate_up, down, chosen, weights, TorchOps.silu_mul)
    grouped, reference = grouped_experts(*args), reference_experts(*args)
    error = (grouped.double() - reference.double()).norm() / reference.double().norm()
    assert error.item() < 2e-2


def test_graphs_equal_eager_with_the_same_routing():
    model = tiny_moe(device="cuda", dtype=torch.bfloat16)
    params = SamplingParams(temperature=0, max_tokens=24, n=2, ignore_eos=True)
    runs = []
    for graphs in (True, False):
        config = NativeEngineConfig(
            max_num_seqs=16, block_size=16, num_kv_blocks=64, use_cuda_graphs=graphs, record_routing=True
        )
        native = NativeEngine(model, config=config)
        assert native.path == "family" and native.runner.use_graphs == graphs
        runs.append(native.generate(PROMPTS, params))
    for with_graphs, eager in zip(*runs):
        for got, want in zip(with_graphs, eager):
            assert got.token_ids == want.token_ids
            assert torch.equal(got.routed_experts, want.routed_experts)


def test_greedy_matches_transformers_in_float32():
    """float32 experts run the reference loop (no graphs) on CUDA too."""
    model = tiny_moe(device="cuda")
    native = NativeEngine(model, config=NativeEngineConfig(max_num_seqs=8, block_size=16, num_kv_blocks=64))
    assert native.path == "family" and not native.runner.use_graphs
    for prompt, completions in zip(
        PROMPTS, native.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    ):
        assert completions[0].token_ids == hf_greedy(model, prompt, 16)


def test_expert_adapters_grouped_equal_the_reference_and_peft_in_bfloat16():
    """LoRA on the experts (rank 4, padded to 8 for the grouped products): the grouped products
    against the reference loop and PEFT's forward, in bfloat16."""
    pytest.importorskip("peft")
    if not grouped_mm_runs(torch.device("cuda"), torch.bfloat16):
        pytest.skip("torch._grouped_mm does not run on this GPU")
    policy = expert_lora(tiny_moe(device="cuda", dtype=torch.bfloat16))
    block = policy.get_base_model().model.layers[0].mlp
    adapters = expert_adapters(block.experts)
    experts = block.experts.get_base_layer()
    x = torch.randn(300, 64, device="cuda", dtype=torch.bfloat16)
    weights, chosen = route(x, block.gate.weight, 2, True)
    args = (x, experts.gate_up_proj, experts.down_proj, chosen, weights, TorchOps.silu_mul)
    with torch.no_grad():
        grouped, reference = grouped_experts(*args, adapters), reference_experts(*args, adapters)
        expected, plain = block(x[None])[0], grouped_experts(*args)
    for got in (grouped, reference):
        error = (got.double() - expected.double()).norm() / expected.double().norm()
        assert error.item() < 2e-2
    assert ((plain.double() - expected.double()).norm() / expected.double().norm()).item() > 0.1


def test_expert_adapters_in_graphs_equal_eager_and_follow_peft():
    """Decode steps replayed from CUDA graphs give the eager steps' tokens; sampled tokens'
    log-probs stay near PEFT's forward (which merges the experts' update in bfloat16)."""
    pytest.importorskip("peft")
    policy = expert_lora(tiny_moe(device="cuda", dtype=torch.bfloat16))
    greedy = SamplingParams(temperature=0, max_tokens=16, n=1, ignore_eos=True)
    sampled = SamplingParams(temperature=0.7, max_tokens=16, n=2, ignore_eos=True, seed=1)
    runs, engines = [], []
    for graphs in (True, False):
        config = NativeEngineConfig(max_num_seqs=8, block_size=16, num_kv_blocks=64, use_cuda_graphs=graphs)
        native = NativeEngine(policy.get_base_model(), config=config)
        assert native.path == "family" and native.runner.use_graphs == graphs
        runs.append(native.generate(PROMPTS, greedy))
        engines.append(native)
    for with_graphs, eager in zip(*runs):
        assert with_graphs[0].token_ids == eager[0].token_ids
    for prompt, completions in zip(PROMPTS, engines[0].generate(PROMPTS, sampled)):
        for completion in completions:
            expected = forward_logprobs(policy, prompt, completion.token_ids, 0.7)
            assert max(abs(a - b) for a, b in zip(completion.logprobs, expected)) < 0.2
