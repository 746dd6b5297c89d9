"""Gemma 3 (text) on the native engine's CUDA path: Gemma's norm kernel against its reference, the
bfloat16 family path (Triton kernels, CUDA graphs) against transformers on a small random shape
whose prompts run past the sliding window, graphs against eager, and float32 greedy decoding
token for token."""

from __future__ import annotations

import pytest
import torch
from helpers.native_fixtures import forward_logprobs, hf_greedy, tiny_gemma3

from grpoflow.engines.base import SamplingParams
from grpoflow.engines.native import NativeEngine, NativeEngineConfig
from grpoflow.kernels.ops import TorchOps

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
SHAPE = dict(
    hidden_size=512,
    intermediate_size=1024,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=128,
    query_pre_attn_scalar=128,
    layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
    sliding_window=24,
    max_position_embeddings=512,
    initializer_range=0.06,
    tie_word_embeddings=False,
)
"""A small Gemma 3 shape: 128-wide heads, four query heads per KV head, a window of 24 tokens;
weights drawn wide and an output head of its own, so that greedy tokens vary (tied to the
sqrt(hidden)-scaled embeddings, small weights repeat the prompt's last token)."""
PROMPTS = [list(range(3, 40)), [5, 6, 7] * 12, [9, 10, 11]]
EXACT_TOKENS = 6
"""Greedy tokens that must equal transformers' in bfloat16 (later ones may part on a near tie)."""


def engine(model, graphs: bool = True) -> NativeEngine:
    config = NativeEngineConfig(max_num_seqs=16, block_size=16, num_kv_blocks=64, use_cuda_graphs=graphs)
    native = NativeEngine(model, config=config)
    assert native.path == "family" and native.runner.use_triton
    return native


def test_gemma_norm_kernel_matches_the_reference():
    from grpoflow.kernels.decoder import TritonOps

    x, residual = torch.randn(2, 37, 640, device="cuda", dtype=torch.bfloat16).unbind(0)
    weight = torch.randn(640, device="cuda", dtype=torch.bfloat16)
    for res in (None, residual):
        out, summed = TritonOps.rms_norm(x, weight, 1e-6, res, unit_offset=True)
        ref, ref_summed = TorchOps.rms_norm(x, weight, 1e-6, res, unit_offset=True)
        error = (out.double() - ref.double()).norm() / ref.double().norm()
        assert error.item() < 1e-2 and torch.equal(summed, ref_summed)


def test_bfloat16_family_path_follows_transformers():
    model = tiny_gemma3(device="cuda", dtype=torch.bfloat16, **SHAPE)
    native = engine(model)
    assert native.runner.use_graphs
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    for prompt, completions in zip(PROMPTS, native.generate(PROMPTS, params)):
        tokens = completions[0].token_ids
        assert tokens[:EXACT_TOKENS] == hf_greedy(model, prompt, EXACT_TOKENS)
        reference = forward_logprobs(model, prompt, tokens, 1.0)
        assert max(abs(a - b) for a, b in zip(completions[0].logprobs, reference)) < 0.1


def test_graphs_equal_eager():
    model = tiny_gemma3(device="cuda", dtype=torch.bfloat16, **SHAPE)
    params = SamplingParams(temperature=0, max_tokens=24, n=2, ignore_eos=True)
    runs = [engine(model, graphs).generate(PROMPTS, params) for graphs in (True, False)]
    for with_graphs, eager in zip(*runs):
        assert [c.token_ids for c in with_graphs] == [c.token_ids for c in eager]


def test_greedy_matches_transformers_in_float32():
    model = tiny_gemma3(device="cuda", **SHAPE)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    for prompt, completions in zip(PROMPTS, engine(model).generate(PROMPTS, params)):
        assert completions[0].token_ids == hf_greedy(model, prompt, 16)
