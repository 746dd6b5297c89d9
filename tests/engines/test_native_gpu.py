"""The native engine's CUDA path: Triton kernels against the torch references, graphs against
eager, and greedy decoding against transformers on the GPU."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers.native_fixtures import FAMILIES, forward_logprobs, hf_greedy, tiny

from grpoflow.engines.base import SamplingParams
from grpoflow.engines.native import NativeEngine, NativeEngineConfig
from grpoflow.engines.native.sampler import SamplingOptions, sample_reference
from grpoflow.kernels.ops import DecodeBatch, TorchOps

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
DTYPES = [torch.float32, torch.bfloat16]
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


@pytest.fixture(scope="module")
def kernels():
    from grpoflow.kernels import decoder as kernels

    return kernels.TritonOps


def relative_error(out: torch.Tensor, reference: torch.Tensor) -> float:
    assert torch.isfinite(out).all()
    return ((out.double() - reference.double()).norm() / reference.double().norm()).item()


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm(kernels, dtype):
    x, residual = torch.randn(2, 37, 896, device="cuda", dtype=dtype).unbind(0)
    weight = torch.randn(896, device="cuda", dtype=dtype)
    for res in (None, residual):
        out, new_residual = kernels.rms_norm(x, weight, 1e-6, res)
        ref, ref_residual = TorchOps.rms_norm(x, weight, 1e-6, res)
        assert relative_error(out, ref) < TOLERANCE[dtype]
        assert torch.equal(new_residual, ref_residual)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("qk_norm", [False, True])
def test_rope_and_store(kernels, dtype, qk_norm):
    tokens, num_heads, num_kv_heads, head_dim, blocks, block_size = 23, 14, 2, 64, 9, 16
    qkv = torch.randn(tokens, (num_heads + 2 * num_kv_heads) * head_dim, device="cuda", dtype=dtype)

    def views(fused):  # q, k, v as views of one fused product, as the engine has them
        q, k, v = fused.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], -1)
        heads = (num_heads, num_kv_heads, num_kv_heads)
        return [t.view(tokens, h, head_dim) for t, h in zip((q, k, v), heads)]

    half_angles = torch.rand(100, head_dim // 2, device="cuda") * 6
    angles = torch.cat((half_angles, half_angles), dim=-1)  # rotary tables repeat their halves
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    positions = torch.randint(0, 100, (tokens,), device="cuda")
    slots = torch.randperm(blocks * block_size, device="cuda")[:tokens]
    slots[3] = -1
    norm = None
    if qk_norm:
        norm = (
            torch.randn(head_dim, device="cuda", dtype=dtype),
            torch.randn(head_dim, device="cuda", dtype=dtype),
            1e-6,
        )
    results = []
    for ops in (kernels, TorchOps):
        caches = torch.full((2, blocks, num_kv_heads, block_size, head_dim), 7.0, device="cuda", dtype=dtype)
        q_out, k_out, v = views(qkv.clone())
        ops.rope_and_store(q_out, k_out, v, cos, sin, positions, slots, caches[0], caches[1], norm)
        results.append((q_out, k_out, caches))
    (q1, k1, c1), (q2, k2, c2) = results
    assert relative_error(q1, q2) < TOLERANCE[dtype]
    assert relative_error(k1, k2) < TOLERANCE[dtype]
    assert relative_error(c1, c2) < TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul(kernels, dtype):
    gate, up = torch.randn(2, 33, 4864, device="cuda", dtype=dtype).unbind(0)
    assert relative_error(kernels.silu_mul(gate, up), TorchOps.silu_mul(gate, up)) < TOLERANCE[dtype]
    gate, up = torch.randn(33, 2 * 4864, device="cuda", dtype=dtype).split(4864, dim=-1)  # one fused product
    assert relative_error(kernels.silu_mul(gate, up), TorchOps.silu_mul(gate, up)) < TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [0, 37])
@pytest.mark.parametrize("group", [1, 7])
@pytest.mark.parametrize("qk_norm", [False, True])
def test_decode_layer_attention(kernels, dtype, window, group, qk_norm):
    rows, num_kv_heads, head_dim, block_size, blocks = 19, 2, 64, 16, 400
    num_heads = num_kv_heads * group
    qkv = torch.randn(rows, (num_heads + 2 * num_kv_heads) * head_dim, device="cuda", dtype=dtype)
    half_angles = torch.rand(400, head_dim // 2, device="cuda") * 6
    angles = torch.cat((half_angles, half_angles), dim=-1)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    # Each row writes into its own blocks, as the scheduler guarantees (shared blocks are full).
    table = torch.randperm(blocks, device="cuda")[: rows * 20].view(rows, 20).int()
    context = torch.randint(1, 20 * block_size, (rows,), device="cuda")
    context[0], context[1] = 0, 1  # an idle row, and a row whose only context is its new token
    positions = (context - 1).clamp(min=0)
    slots = table[torch.arange(rows), positions // block_size].long() * block_size + positions % block_size
    slots = torch.where(context > 0, slots, -1)
    batch = DecodeBatch(cos, sin, positions, slots, table, context, int(context.max()))
    norm = None
    if qk_norm:
        norm = tuple(torch.randn(head_dim, device="cuda", dtype=dtype) for _ in range(2)) + (1e-6,)
    results = []
    for ops in (kernels, TorchOps):
        caches = torch.randn(2, blocks, num_kv_heads, block_size, head_dim, device="cuda", dtype=dtype,
                             generator=torch.Generator("cuda").manual_seed(0))  # fmt: skip
        q, k, v = qkv.clone().split(
            [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], -1
        )
        q, k, v = q.view(rows, num_heads, -1), k.view(rows, num_kv_heads, -1), v.view(rows, num_kv_heads, -1)
        out = ops.decode_layer_attention(q, k, v, caches[0], caches[1], batch, head_dim**-0.5, window, norm)
        results.append((out, caches))
    (out, caches), (ref, ref_caches) = results
    assert (out[0] == 0).all()
    assert relative_error(out[1:], ref[1:]) < TOLERANCE[dtype] * 2
    assert relative_error(caches, ref_caches) < TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
def test_paged_prefix_attention(dtype):
    from helpers.prefix_attention import check_paged_prefix_attention

    check_paged_prefix_attention("cuda", dtype, TOLERANCE[dtype])


@pytest.mark.parametrize(("greedy", "filters"), [(True, False), (False, False), (False, True)])
def test_sample_kernel_matches_reference(greedy, filters):
    from grpoflow.kernels.decoder import sample_rows

    logits = torch.randn(256, 151936, device="cuda", dtype=torch.bfloat16) * 3
    keys = torch.from_numpy(np.random.default_rng(0).integers(0, 2**32, 256)).cuda()
    options = SamplingOptions.from_params(
        SamplingParams(temperature=0.8, top_p=0.9 if filters else 1.0, top_k=50 if filters else 0)
    )
    thresholds = options.truncation.thresholds(logits.float() / 0.8)
    inverse = 1.0 if greedy else 1 / 0.8
    tokens, logprobs = sample_rows(logits, keys, inverse, greedy, thresholds)
    ref_tokens, ref_logprobs = sample_reference(logits, keys, inverse, greedy, thresholds)
    assert (tokens == ref_tokens).float().mean() > 0.99
    same = tokens == ref_tokens
    torch.testing.assert_close(logprobs[same], ref_logprobs[same], atol=1e-3, rtol=1e-4)


@pytest.mark.parametrize("model_type", FAMILIES)
def test_greedy_matches_transformers_on_cuda(model_type):
    model = tiny(model_type, device="cuda")
    native = NativeEngine(model, config=NativeEngineConfig(max_num_seqs=8, block_size=16, num_kv_blocks=64))
    prompts = [[5, 6, 7, 8, 9], [10, 11, 12], list(range(2, 40))]
    outputs = native.generate(prompts, SamplingParams(temperature=0, max_tokens=64, n=2, ignore_eos=True))
    assert native.runner.use_graphs and native.runner.graphs
    for prompt, completions in zip(prompts, outputs):
        reference = hf_greedy(model, prompt, 64)
        assert all(completion.token_ids == reference for completion in completions)


def test_graphs_equal_eager_and_logprobs_match_forward():
    model = tiny("qwen2", device="cuda", dtype=torch.bfloat16, hidden_size=256, num_attention_heads=4)
    prompts = [list(range(3, 30)), [4, 5, 6]]
    params = SamplingParams(temperature=0.9, max_tokens=40, n=4, seed=5, ignore_eos=True)
    runs = []
    for graphs in (True, False):
        config = NativeEngineConfig(max_num_seqs=16, block_size=16, num_kv_blocks=64, use_cuda_graphs=graphs)
        runs.append(NativeEngine(model, config=config).generate(prompts, params))
    assert [[c.token_ids for c in group] for group in runs[0]] == [
        [c.token_ids for c in group] for group in runs[1]
    ]
    for prompt, completions in zip(prompts, runs[0]):
        for completion in completions:
            expected = forward_logprobs(model, prompt, completion.token_ids, 0.9)
            np.testing.assert_allclose(completion.logprobs, expected, atol=0.1)


def test_memory_fraction_sizes_cache_and_sleep_frees_it():
    model = tiny("llama", device="cuda")
    native = NativeEngine(model, config=NativeEngineConfig(gpu_memory_utilization=0.2, max_model_len=512))
    native.wake_up()
    taken, reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    native.sleep()
    assert torch.cuda.memory_allocated() < taken - 2**20
    assert torch.cuda.memory_reserved() == reserved  # the process's allocator keeps it for the update
    native.generate([[3, 4]], SamplingParams(temperature=0, max_tokens=4))
    assert native.runner.awake


@pytest.mark.parametrize("model_type", ["qwen2", "qwen3"])
def test_prefix_cache_keeps_outputs_on_cuda(model_type):
    model = tiny(model_type, device="cuda")
    prompts = [list(range(3, 40)), [5, 6, 7] * 12, list(range(3, 40))]
    params = SamplingParams(temperature=0, max_tokens=30, n=2, ignore_eos=True)
    runs = []
    for caching in (True, False):
        config = NativeEngineConfig(
            max_num_seqs=16, block_size=16, num_kv_blocks=64, enable_prefix_caching=caching
        )
        native = NativeEngine(model, config=config)
        first = native.generate(prompts, params)
        following = [prompt + group[0].token_ids + [9] * 7 for prompt, group in zip(prompts, first)]
        second = native.generate(following, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
        assert native.runner.use_triton and native.runner.use_graphs
        runs.append((first, second, native.stats.prefill.num_cached_tokens))
    (cached_first, cached_second, hits), (plain_first, plain_second, plain_hits) = runs
    assert hits > 0 and plain_hits == 0
    for cached, plain in ((cached_first, plain_first), (cached_second, plain_second)):
        assert [[c.token_ids for c in group] for group in cached] == [
            [c.token_ids for c in group] for group in plain
        ]
        for group, plain_group in zip(cached, plain):
            for completion, expected in zip(group, plain_group):
                np.testing.assert_allclose(completion.logprobs, expected.logprobs, atol=1e-4)


def _tokens(outputs) -> list[list[list[int]]]:
    return [[completion.token_ids for completion in group] for group in outputs]


def _graphed_engine():
    """A tiny model, an engine on it that decodes in graphs, a call, and that call's tokens."""
    model = tiny("qwen2", device="cuda")
    native = NativeEngine(model, config=NativeEngineConfig(max_num_seqs=8, block_size=16, num_kv_blocks=64))
    prompts = [list(range(3, 20)), [4, 5, 6]]
    params = SamplingParams(temperature=0, max_tokens=24, n=2, ignore_eos=True)
    return model, native, prompts, params, _tokens(native.generate(prompts, params))


def test_graphs_captured_again_when_the_weights_move():
    # FSDP gathers each rollout's weights to new addresses: every call captures its graphs again,
    # into the pool the last call's graphs shared, and decodes as the first call did.
    model, native, prompts, params, expected = _graphed_engine()
    for _ in range(3):
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.data = parameter.data.clone()
        assert _tokens(native.generate(prompts, params)) == expected
        assert native.runner.graphs and native.runner.retired_graph is None


def test_capture_after_clear_while_the_old_pool_holds_a_block(monkeypatch):
    # A block the last capture allocated and something still holds keeps the dropped graphs' pool
    # in the allocator; capturing into it again must not find it without a user.
    _, native, prompts, params, expected = _graphed_engine()
    family, held = native.runner.family, []
    forward = family.forward

    def forward_holding_a_block(*args, **kwargs):
        if torch.cuda.is_current_stream_capturing():
            held.append(torch.empty(4096, device="cuda"))
        return forward(*args, **kwargs)

    monkeypatch.setattr(family, "forward", forward_holding_a_block)
    for _ in range(3):
        native.runner.clear_graphs()
        assert _tokens(native.generate(prompts, params)) == expected
    assert len(held) == 3


def test_sleeping_between_calls_captures_into_the_same_pool():
    # A release keeps the graphs' pool (and one graph using it) for the next wake's captures: the
    # memory the process holds stays flat over sleep and wake cycles, and the outputs the same.
    model, native, prompts, params, expected = _graphed_engine()
    pool, reserved = native.runner.graph_pool, []
    for _ in range(4):
        native.sleep()
        assert not native.runner.graphs and native.runner.retired_graph is not None
        assert _tokens(native.generate(prompts, params)) == expected
        reserved.append(torch.cuda.memory_reserved())
    assert native.runner.graph_pool == pool and len(set(reserved[1:])) == 1
