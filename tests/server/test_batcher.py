"""The batcher on hand-written fake engines (grouping, error isolation, the gate) and on the native
engine (turns)."""

from __future__ import annotations

import asyncio

import pytest
from helpers.native_fixtures import tiny

from grpoflow.engines.base import Completion, EngineCapabilities, SamplingParams
from grpoflow.engines.native import NativeEngine, NativeEngineConfig
from grpoflow.server.batcher import Batcher
from grpoflow.server.errors import RequestError


class OneParamsEngine:
    """Like the hf engine: one SamplingParams per call. Answers token = prompt's first id."""

    capabilities = EngineCapabilities(name="hf")
    policy_version = 0

    def __init__(self) -> None:
        self.calls: list[tuple[list[list[int]], SamplingParams]] = []

    def generate(self, prompts, params):
        self.calls.append((list(prompts), params))
        if any(prompt[0] == 0 for prompt in prompts):
            raise ValueError("prompt starts with 0")
        return [[Completion([prompt[0]], [-1.0], "length") for _ in range(params.n)] for prompt in prompts]


class PerPromptEngine(OneParamsEngine):
    """Like the native engine: one SamplingParams per prompt, error completions, and requests that
    join the running call through its intake (each answered in the step it joins)."""

    capabilities = EngineCapabilities(name="native", per_prompt_params=True)

    def generate(self, prompts, params, *, on_error="raise", intake=None):
        self.calls.append((list(prompts), params))
        while arrivals := intake():
            if any(prompt[0] == 99 for prompts, _, _ in arrivals for prompt in prompts):
                raise ValueError("the engine broke on 99")
            for prompts, params, sink in arrivals:
                sink(
                    [
                        [Completion([], [], "error", text="bad prompt")] * request.n
                        if prompt[0] == 0
                        else [Completion([prompt[0]], [-1.0], "length")] * request.n
                        for prompt, request in zip(prompts, params)
                    ]
                )
        return []


async def serve_together(engine, requests):
    batcher = Batcher(engine, window_s=0.01)
    batcher.start()
    try:
        futures = [batcher.submit(prompts, params) for prompts, params in requests]
        return await asyncio.gather(*futures, return_exceptions=True)
    finally:
        await batcher.stop()


def test_an_engine_with_one_params_per_call_gets_one_call_per_distinct_params():
    engine = OneParamsEngine()
    a, b = SamplingParams(n=2, max_tokens=3), SamplingParams(n=1, max_tokens=3)
    results = asyncio.run(serve_together(engine, [([[5]], a), ([[6], [7]], b), ([[8]], a)]))
    assert len(engine.calls) == 2
    assert sorted(len(prompts) for prompts, _ in engine.calls) == [2, 2]
    assert [[c.token_ids for c in group] for group in results[0]] == [[[5], [5]]]
    assert [[c.token_ids for c in group] for group in results[1]] == [[[6]], [[7]]]
    assert [[c.token_ids for c in group] for group in results[2]] == [[[8], [8]]]


def test_a_per_prompt_engine_gets_one_call_per_distribution():
    engine = PerPromptEngine()
    requests = [
        ([[5]], SamplingParams(n=2, max_tokens=3, seed=1)),
        ([[6]], SamplingParams(n=1, max_tokens=9)),
        ([[7]], SamplingParams(n=1, temperature=0.5)),
    ]
    results = asyncio.run(serve_together(engine, requests))
    assert len(engine.calls) == 2
    assert [len(group) for group in results[0]] == [2]


@pytest.mark.parametrize("engine_type", [OneParamsEngine, PerPromptEngine])
def test_a_bad_request_fails_alone(engine_type):
    params = SamplingParams(n=1, max_tokens=2)
    results = asyncio.run(serve_together(engine_type(), [([[5]], params), ([[0]], params), ([[6]], params)]))
    assert isinstance(results[1], RequestError) and results[1].status == 400
    assert results[0][0][0].token_ids == [5] and results[2][0][0].token_ids == [6]


def test_a_request_that_breaks_a_call_of_several_fails_alone():
    engine = PerPromptEngine()
    params = SamplingParams(n=1, max_tokens=2)
    results = asyncio.run(serve_together(engine, [([[5]], params), ([[99]], params), ([[6]], params)]))
    assert isinstance(results[1], RequestError) and "broke on 99" in str(results[1])
    assert results[0][0][0].token_ids == [5] and results[2][0][0].token_ids == [6]
    assert len(engine.calls) == 4  # together, then each alone


def test_a_hold_waits_for_the_running_batch_and_blocks_the_next():
    async def scenario():
        engine = OneParamsEngine()
        batcher = Batcher(engine, window_s=0)
        batcher.start()
        await batcher.hold()
        pending = batcher.submit([[5]], SamplingParams(max_tokens=1))
        await asyncio.sleep(0.05)
        assert not pending.done() and engine.calls == []
        await batcher.release()
        result = await pending
        await batcher.stop()
        return result

    assert asyncio.run(scenario())[0][0].token_ids == [5]


LONG = SamplingParams(n=16, max_tokens=24, ignore_eos=True, seed=7)
"""32 sequences over 4 rows: 8 waves of 24 steps."""


def native(**config):
    engine = NativeEngine(
        tiny("qwen2"), config=NativeEngineConfig(max_num_seqs=4, num_kv_blocks=256, **config)
    )
    engine.wake_up()
    return engine


async def started(batcher: Batcher, prompts, params) -> asyncio.Future:
    """Submit a request and wait until the engine call serving it runs."""
    future = batcher.submit(prompts, params)
    while batcher.num_batches == 0:
        await asyncio.sleep(0.001)
    return future


def tokens(groups) -> list[list[list[int]]]:
    return [[completion.token_ids for completion in group] for group in groups]


def test_a_short_request_joins_a_running_call_and_takes_the_first_free_row():
    """A long request (3 rows for 200 tokens) and a brief one (1 row, 4 tokens) run; a request
    sent meanwhile joins their engine call, takes the brief one's row when it frees and is
    answered while the long one still runs (not once the call, or a turn of it, ends). A seeded
    request that joined draws what it draws alone, and so does the long one."""
    engine = native()
    long = SamplingParams(n=3, max_tokens=200, ignore_eos=True, seed=7)
    short = SamplingParams(n=2, max_tokens=3, temperature=1.0, seed=11)

    async def scenario():
        batcher = Batcher(engine, window_s=0)
        batcher.start()
        try:
            big = batcher.submit([[5, 6, 7]], long)
            await started(batcher, [[8, 9]], SamplingParams(max_tokens=4, ignore_eos=True))
            small = await batcher.submit([[3, 4]], short)
            big_done_then = big.done()
            return small, big_done_then, await big, batcher
        finally:
            await batcher.stop()

    small, big_done_then, big, batcher = asyncio.run(scenario())
    assert not big_done_then and [len(c.token_ids) for c in small[0]] == [3, 3]
    assert (batcher.num_engine_calls, batcher.num_joined) == (1, 1)
    assert tokens(small) == tokens(engine.generate([[3, 4]], short))
    assert tokens(big) == tokens(engine.generate([[5, 6, 7]], long))


def test_a_request_with_other_distribution_fields_waits_for_the_next_call():
    engine = native()

    async def scenario():
        batcher = Batcher(engine, window_s=0)
        batcher.start()
        try:
            big = await started(batcher, [[5, 6, 7]], LONG)
            other = batcher.submit([[3, 4]], SamplingParams(max_tokens=2, temperature=0.5))
            await other
            return big.done(), batcher
        finally:
            await batcher.stop()

    big_done, batcher = asyncio.run(scenario())
    assert big_done and (batcher.num_engine_calls, batcher.num_joined) == (2, 0)


def test_a_hold_lets_nothing_join_and_lands_after_the_running_call():
    """A weight update asked for while a call runs: requests sent meanwhile do not join it, the
    update runs once the call's requests are answered, and the new requests after it."""
    engine = native()
    order = []

    async def scenario():
        batcher = Batcher(engine, window_s=0)
        batcher.start()
        try:
            big = await started(batcher, [[5, 6, 7]], LONG)
            big.add_done_callback(lambda _: order.append("big"))
            update = asyncio.ensure_future(batcher.exclusive(order.append, "update"))
            while batcher.is_open:
                await asyncio.sleep(0)
            small = batcher.submit([[3, 4]], SamplingParams(max_tokens=1))
            small.add_done_callback(lambda _: order.append("small"))
            await asyncio.gather(update, small)
            return batcher
        finally:
            await batcher.stop()

    batcher = asyncio.run(scenario())
    assert order == ["big", "update", "small"]
    assert (batcher.num_engine_calls, batcher.num_joined) == (2, 0)


def test_a_joined_request_whose_client_left_stops_and_gives_its_rows_back():
    engine = native(block_size=4)
    free_before = engine.runner.pool.num_free

    async def scenario():
        batcher = Batcher(engine, window_s=0)
        batcher.start()
        try:
            big = await started(batcher, [[5, 6, 7]], LONG)
            gone = batcher.submit([[3, 4]], SamplingParams(n=8, max_tokens=200, ignore_eos=True))
            while batcher.num_joined == 0:
                await asyncio.sleep(0.001)
            gone.cancel()
            return await big
        finally:
            await batcher.stop()

    big = asyncio.run(scenario())
    assert [len(c.token_ids) for c in big[0]] == [24] * 16
    assert engine.stats.num_generated_tokens < 16 * 24 + 8 * 50
    assert int(engine.runner.pool.refs.sum()) == 0 and engine.runner.pool.num_free == free_before


def test_a_call_takes_no_more_than_call_sequences():
    engine = native()

    async def scenario():
        batcher = Batcher(engine, window_s=0, call_sequences=20)
        batcher.start()
        try:
            big = await started(batcher, [[5, 6, 7]], LONG)
            joined = batcher.submit([[3, 4]], SamplingParams(n=4, max_tokens=2))
            late = batcher.submit([[3, 4]], SamplingParams(n=1, max_tokens=2))
            await asyncio.gather(big, joined, late)
            return batcher
        finally:
            await batcher.stop()

    batcher = asyncio.run(scenario())
    assert (batcher.num_engine_calls, batcher.num_joined) == (2, 1)
