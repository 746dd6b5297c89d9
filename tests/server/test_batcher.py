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
    """Like the native engine: one SamplingParams per prompt and error completions."""

    capabilities = EngineCapabilities(name="native", per_prompt_params=True)

    def generate(self, prompts, params, *, on_error="raise"):
        self.calls.append((list(prompts), params))
        return [
            [Completion([], [], "error", text="bad prompt")] * request.n
            if prompt[0] == 0
            else [Completion([prompt[0]], [-1.0], "length")] * request.n
            for prompt, request in zip(prompts, params)
        ]


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


def test_a_long_request_is_served_in_turns_that_let_a_short_one_through():
    """On the native engine (tiny model, 4 rows), a request of 32 sequences runs in turns of 4:
    a one-token request sent while its first turn runs is answered after at most two batches,
    long before the long one; the long one's seeded samples are those of one whole call."""
    engine = NativeEngine(tiny("qwen2"), config=NativeEngineConfig(max_num_seqs=4, num_kv_blocks=256))
    engine.wake_up()
    long = SamplingParams(n=16, max_tokens=24, ignore_eos=True, seed=7)

    async def scenario():
        batcher = Batcher(engine, window_s=0, turn_sequences=4)
        batcher.start()
        try:
            big = batcher.submit([[5, 6, 7], [8, 9]], long)
            while batcher.num_batches == 0:
                await asyncio.sleep(0.001)
            small = await batcher.submit([[3, 4]], SamplingParams(n=1, max_tokens=1))
            answered_after = batcher.num_batches
            assert not big.done()
            return small, answered_after, await big, batcher.num_batches
        finally:
            await batcher.stop()

    small, answered_after, big, num_batches = asyncio.run(scenario())
    assert len(small[0]) == 1 and answered_after <= 2 and num_batches == 8
    whole = engine.generate([[5, 6, 7], [8, 9]], [long, long])
    assert [[c.token_ids for c in group] for group in big] == [
        [c.token_ids for c in group] for group in whole
    ]
