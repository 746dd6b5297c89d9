"""The native engine's prefix cache on the CPU: outputs equal an engine without it, hits are
counted exactly, blocks are evicted least recently used first and all come back, and the cache is
dropped when the weights change, on sleep and on request."""

from __future__ import annotations

import collections

import numpy as np
import pytest
import torch
from helpers.native_fixtures import one_thread, tiny  # noqa: F401 (a fixture)
from torch.utils._python_dispatch import TorchDispatchMode

from grpoflow.engines.base import PrefillStats, SamplingParams, prefix_cache_metrics
from grpoflow.engines.native import NativeEngine, NativeEngineConfig
from grpoflow.engines.native.block_pool import BlockPool, chain_keys
from grpoflow.kernels.ops import cached_prefill_attention, prefill_attention

BLOCK = 4
PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], list(range(2, 40)), [3] * 17]
CACHEABLE = sum((len(prompt) - 1) // BLOCK * BLOCK for prompt in PROMPTS)  # 4 + 0 + 36 + 16


@pytest.fixture(scope="module")
def model():
    return tiny("qwen2")


def engine(model, caching: bool = True, **kwargs) -> NativeEngine:
    config = dict(max_num_seqs=8, block_size=BLOCK, num_kv_blocks=256, enable_prefix_caching=caching)
    config.update(kwargs)
    return NativeEngine(model, config=NativeEngineConfig(**config))


def greedy(max_tokens: int = 12, n: int = 1) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, n=n, ignore_eos=True)


def assert_same(outputs, reference) -> None:
    assert [[c.token_ids for c in group] for group in outputs] == [
        [c.token_ids for c in group] for group in reference
    ]
    for group, reference_group in zip(outputs, reference):
        for completion, expected in zip(group, reference_group):
            np.testing.assert_allclose(completion.logprobs, expected.logprobs, atol=1e-4)


def counts(native: NativeEngine) -> tuple[int, int]:
    return native.stats.prefill.num_prefill_tokens, native.stats.prefill.num_cached_tokens


def all_blocks_free(native: NativeEngine) -> bool:
    pool = native.runner.pool
    return int(pool.refs.sum()) == 0 and pool.num_free == pool.num_blocks


# The pool


def test_chain_keys_name_the_whole_prefix():
    keys = chain_keys([1, 2, 3, 4, 5, 6, 7, 8, 9], 4)
    assert len(keys) == 2 and keys == chain_keys([1, 2, 3, 4, 5, 6, 7, 8], 4)
    assert chain_keys([0, 2, 3, 4, 5, 6, 7, 8], 4)[1] != keys[1]  # same block, another parent
    assert chain_keys(list(range(12)), 4, 1) == chain_keys(list(range(12)), 4)[:1]


def test_pool_takes_the_longest_keyed_run_and_keeps_idle_blocks_until_needed():
    pool = BlockPool(4, caching=True)
    keys = chain_keys(list(range(12)), 4)
    blocks = pool.allocate(3)
    pool.register(blocks[:2], keys[:2])
    pool.release(blocks)
    assert pool.num_free == 4 and pool.num_cached == 2
    assert pool.take_cached([keys[0], keys[2], keys[1]]) == [blocks[0]]
    assert pool.refs[blocks[0]] == 1 and pool.num_free == 3
    pool.release([blocks[0]])  # now the most recently used
    # unkeyed blocks go first, then the idle keyed ones, least recently used first
    assert sorted(pool.allocate(2)) == sorted([blocks[2], 3])
    assert pool.allocate(1) == [blocks[1]] and pool.take_cached(keys[1:2]) == []
    assert pool.take_cached(keys[:1]) == [blocks[0]]


def test_pool_keeps_the_first_block_of_a_key_and_reset_forgets_all():
    pool = BlockPool(3, caching=True)
    first, second = pool.allocate(2)
    pool.register([first], [7])
    pool.register([second], [7])  # same prefix computed twice: the first block keeps the key
    pool.release([first, second])
    assert pool.take_cached([7]) == [first]
    pool.reset()
    assert pool.num_cached == 0 and pool.take_cached([7]) == [] and pool.refs[first] == 1
    pool.release([first])
    assert pool.num_free == 3


def test_pool_without_caching_keys_nothing():
    pool = BlockPool(2)
    blocks = pool.allocate(1)
    pool.register(blocks, [5])
    assert pool.num_cached == 0 and pool.take_cached([5]) == []


# Attention over a cached prefix


@pytest.mark.parametrize("window", [0, 5])
def test_cached_prefill_attention_equals_causal_attention_over_the_whole_sequence(window):
    torch.manual_seed(0)
    num_kv_heads, num_heads, head_dim, block_size = 2, 4, 8, 4
    lengths, starts = [11, 6], [8, 4]
    q = torch.randn(2, 11, num_heads, head_dim)
    k, v = torch.randn(2, 11, num_kv_heads, head_dim), torch.randn(2, 11, num_kv_heads, head_dim)
    expected = prefill_attention(q, k, v, 0.3, window)
    k_cache = torch.full((10, num_kv_heads, block_size, head_dim), float("nan"))
    v_cache = torch.full((10, num_kv_heads, block_size, head_dim), float("nan"))
    pages = torch.tensor([[7, 2, 5], [1, 9, 0]])
    for item, length in enumerate(lengths):
        for position in range(length):
            block, offset = pages[item, position // block_size], position % block_size
            k_cache[block, :, offset], v_cache[block, :, offset] = k[item, position], v[item, position]
    new = max(length - start for length, start in zip(lengths, starts))
    positions = torch.tensor(
        [[min(start + i, length - 1) for i in range(new)] for start, length in zip(starts, lengths)]
    )
    queries = torch.stack([q[item, positions[item]] for item in range(2)])
    out = cached_prefill_attention(
        queries, k_cache, v_cache, pages, positions, torch.tensor(lengths), 0.3, window
    )
    for item, (start, length) in enumerate(zip(starts, lengths)):
        torch.testing.assert_close(out[item, : length - start], expected[item, start:length])


# The engine


def test_single_turn_outputs_equal_and_the_second_call_hits_every_cacheable_block(model):
    cached, plain = engine(model), engine(model, caching=False)
    first = cached.generate(PROMPTS, greedy())
    assert counts(cached) == (sum(map(len, PROMPTS)), 0)
    second = cached.generate(PROMPTS, greedy())
    assert counts(cached) == (sum(map(len, PROMPTS)) - CACHEABLE, CACHEABLE)
    reference = plain.generate(PROMPTS, greedy())
    assert counts(plain) == (sum(map(len, PROMPTS)), 0)
    plain.generate(PROMPTS, greedy())
    assert counts(plain) == (sum(map(len, PROMPTS)), 0)
    assert_same(first, reference)
    assert_same(second, reference)
    assert all_blocks_free(cached)


def test_groups_and_identical_prompts_of_one_call_share_the_prompt_blocks(model):
    prompt = list(range(3, 20))  # 17 tokens: 4 cacheable blocks
    cached, plain = engine(model), engine(model, caching=False)
    outputs = cached.generate([prompt, prompt, prompt], greedy(n=2))
    # the first prompt is prefilled whole; the others, in the same step, read its 16 cached tokens
    assert counts(cached) == (17 + 1 + 1, 16 + 16) and cached.stats.extra["prefill_steps"] == 1
    reference = plain.generate([prompt], greedy(n=2))
    assert_same(outputs, reference * 3)
    assert all_blocks_free(cached)


def test_a_multi_turn_continuation_reuses_the_prompt_and_the_completion(model):
    prompt = list(range(2, 40))  # 38 tokens
    cached, plain = engine(model), engine(model, caching=False)
    (first,) = cached.generate([prompt], greedy(max_tokens=20, n=2))
    assert_same([first], plain.generate([prompt], greedy(max_tokens=20, n=2)))
    # each episode's environment answers differently
    following = [prompt + c.token_ids + [41 + index] * 5 for index, c in enumerate(first)]
    second = cached.generate(following, greedy(max_tokens=16))
    # every token but the last sampled one was fed to the model: 57 of them, 14 full blocks
    written = (len(prompt) + 20 - 1) // BLOCK * BLOCK
    assert counts(cached) == (2 * (len(following[0]) - written), 2 * written)
    assert_same(second, plain.generate(following, greedy(max_tokens=16)))
    assert all_blocks_free(cached)


class OpCounter(TorchDispatchMode):
    """Counts the aten operations run inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[str(func)] += 1
        return func(*args, **(kwargs or {}))


def test_a_cached_prefill_builds_its_gather_and_masks_once_not_per_layer():
    mask_ops = ("aten.arange.default", "aten.le.Tensor", "aten.lt.Tensor")
    seen = {}
    for layers in (2, 4):
        native = engine(tiny("qwen2", num_hidden_layers=layers))
        native.generate([list(range(3, 20))], greedy(max_tokens=3))
        counter, prefill = OpCounter(), native.runner.prefill

        def counted(*args, prefill=prefill, counter=counter):
            with counter:
                return prefill(*args)

        native.runner.prefill = counted
        native.generate([list(range(3, 23))], greedy(max_tokens=3))  # 16 tokens from the cache
        assert counts(native)[1] == 16
        seen[layers] = [counter.counts[op] for op in mask_ops]
    assert seen[2] == seen[4], seen


def test_sampled_outputs_equal_with_and_without_the_cache(model):
    params = SamplingParams(temperature=1.0, max_tokens=10, n=3, seed=11)
    cached, plain = engine(model), engine(model, caching=False)
    cached.generate(PROMPTS, params)
    assert_same(cached.generate(PROMPTS, params), plain.generate(PROMPTS, params))


def test_least_recently_used_blocks_are_evicted_when_the_cache_is_full(model):
    # 12 blocks; each call's 17-token prompt leaves 4 keyed blocks, 5 are used while it runs
    a, b, c = ([token] * 4 + list(range(20, 33)) for token in (40, 41, 42))
    cached = engine(model, num_kv_blocks=12)
    fresh = engine(model, caching=False, num_kv_blocks=12)
    for prompt in (a, b, c):
        cached.generate([prompt], greedy(max_tokens=3))
        assert counts(cached) == (17, 0)
    outputs = cached.generate([b], greedy(max_tokens=3))  # c took the block of a's first 4 tokens
    assert counts(cached) == (1, 16)
    assert_same(outputs, fresh.generate([b], greedy(max_tokens=3)))
    outputs = cached.generate([a], greedy(max_tokens=3))
    assert counts(cached) == (17, 0)
    assert_same(outputs, fresh.generate([a], greedy(max_tokens=3)))
    assert all_blocks_free(cached)


def test_preemption_under_a_small_cache_keeps_outputs_and_returns_every_block(model):
    prompts = [list(range(2 + index, 20 + index)) for index in range(6)]
    cached = engine(model, num_kv_blocks=24, max_num_seqs=6)
    reference = engine(model, caching=False).generate(prompts, greedy(max_tokens=24))
    outputs = cached.generate(prompts, greedy(max_tokens=24))
    assert cached.stats.extra["preemptions"] > 0
    assert_same(outputs, reference)
    assert all_blocks_free(cached)


def test_new_weights_drop_the_cache(model):
    changed = tiny("qwen2")
    cached = engine(changed)
    cached.generate(PROMPTS, greedy())
    other = tiny("qwen2", seed=1)
    cached.update_weights(other.named_parameters(), version=1)
    outputs = cached.generate(PROMPTS, greedy())
    assert counts(cached) == (sum(map(len, PROMPTS)), 0)
    assert_same(outputs, engine(other, caching=False).generate(PROMPTS, greedy()))


def test_weights_changed_in_place_drop_the_cache():
    policy = tiny("qwen2")
    cached = engine(policy)
    cached.generate(PROMPTS, greedy())
    with torch.no_grad():  # as an optimizer step does, with no update_weights call
        for parameter in policy.parameters():
            parameter.mul_(1.5)
    outputs = cached.generate(PROMPTS, greedy())
    assert counts(cached) == (sum(map(len, PROMPTS)), 0)
    assert_same(outputs, engine(policy, caching=False).generate(PROMPTS, greedy()))


def test_weights_given_new_storage_drop_the_cache():
    policy = tiny("qwen2")
    cached = engine(policy)
    cached.generate(PROMPTS, greedy())
    for parameter in policy.parameters():  # as a sharded policy gathered into new buffers
        parameter.data = parameter.detach() * 1.5
    outputs = cached.generate(PROMPTS, greedy())
    assert counts(cached) == (sum(map(len, PROMPTS)), 0)
    assert_same(outputs, engine(policy, caching=False).generate(PROMPTS, greedy()))


def test_sleep_and_reset_drop_the_cache(model):
    cached = engine(model)
    cached.generate(PROMPTS, greedy())
    cached.sleep()
    cached.wake_up()
    cached.generate(PROMPTS, greedy())
    assert counts(cached) == (sum(map(len, PROMPTS)), 0)
    cached.reset_prefix_cache()
    cached.generate(PROMPTS, greedy())
    assert counts(cached) == (sum(map(len, PROMPTS)), 0)
    cached.generate(PROMPTS, greedy())
    assert counts(cached)[1] == CACHEABLE


def test_a_failed_call_leaves_every_block_free(model):
    cached = engine(model)
    cached.generate(PROMPTS, greedy())
    with pytest.raises(ValueError, match="stop strings need a tokenizer"):
        cached.generate(PROMPTS, SamplingParams(max_tokens=4, stop=["x"]))
    nan_model = tiny("qwen2")
    broken = engine(nan_model)
    broken.generate(PROMPTS, greedy())
    with torch.no_grad():
        nan_model.lm_head.weight.fill_(float("nan"))
    with pytest.raises(RuntimeError, match="NaN"):
        broken.generate(PROMPTS, greedy())
    assert all_blocks_free(broken) and broken.runner.pool.num_cached == 0


def test_rollout_metrics_from_prefill_stats():
    stats = PrefillStats(30, 10) + PrefillStats(10, 30)
    assert prefix_cache_metrics(stats) == {
        "rollout/prefill_tokens": 40.0,
        "rollout/prefix_cache_hit_tokens": 40.0,
        "rollout/prefix_cache_hit_rate": 0.5,
    }
    assert prefix_cache_metrics(None) == {}
    assert prefix_cache_metrics(PrefillStats())["rollout/prefix_cache_hit_rate"] == 0.0
