"""Abandoned prompts stop inside a native `generate` call: their sequences end with finish_reason
'abort' at the next step, the other prompts are served in full, and every cache block comes back."""

from __future__ import annotations

import pytest
from helpers.native_fixtures import one_thread, tiny  # noqa: F401 (a fixture)

from grpoflow.engines.base import SamplingParams
from grpoflow.engines.native import NativeEngine, NativeEngineConfig

MAX_TOKENS = 200


@pytest.fixture(scope="module")
def model():
    return tiny("qwen2")


def after(steps: int, prompts: list[int]):
    """An `abandoned` hook naming `prompts` from its `steps`-th call on; counts its calls."""
    calls = []

    def abandoned() -> list[int]:
        calls.append(None)
        return prompts if len(calls) > steps else []

    abandoned.calls = calls
    return abandoned


@pytest.mark.parametrize("caching", [True, False])
def test_an_abandoned_prompt_stops_and_gives_its_blocks_back(model, caching):
    engine = NativeEngine(
        model,
        config=NativeEngineConfig(
            max_num_seqs=8, block_size=4, num_kv_blocks=512, enable_prefix_caching=caching
        ),
    )
    engine.wake_up()
    pool = engine.runner.pool
    free_before = pool.num_free
    params = SamplingParams(n=12, max_tokens=MAX_TOKENS, ignore_eos=True)  # 24 sequences, 8 rows
    abandoned = after(5, [0])
    big, small = engine.generate([[5, 6, 7, 8, 9], [3, 4]], [params, params], abandoned=abandoned)
    assert {completion.finish_reason for completion in big} == {"abort"}
    assert max(len(completion.token_ids) for completion in big) < 10
    assert all(len(c.logprobs) == len(c.token_ids) for c in big)
    assert [len(c.token_ids) for c in small] == [MAX_TOKENS] * 12
    assert {completion.finish_reason for completion in small} == {"length"}
    assert int(pool.refs.sum()) == 0 and pool.num_free == free_before
    # The small prompt's 12 sequences run in 2 waves of 8 rows; the big one's 12 never ran theirs.
    assert engine.stats.extra["decode_steps"] < 2 * MAX_TOKENS + 10


def test_abandoning_everything_ends_the_call_at_the_next_step(model):
    engine = NativeEngine(model, config=NativeEngineConfig(max_num_seqs=4, num_kv_blocks=256))
    params = SamplingParams(n=8, max_tokens=MAX_TOKENS, ignore_eos=True)
    (group,) = engine.generate([[5, 6, 7]], params, abandoned=after(3, [0]))
    assert {completion.finish_reason for completion in group} == {"abort"}
    assert engine.stats.extra["decode_steps"] <= 4
    assert int(engine.runner.pool.refs.sum()) == 0


def test_the_generic_path_stops_abandoned_prompts_too(model):
    engine = NativeEngine(model, config=NativeEngineConfig(max_num_seqs=4, force_generic=True))
    params = SamplingParams(n=4, max_tokens=50, ignore_eos=True)
    big, small = engine.generate([[5, 6, 7], [3, 4]], [params, params], abandoned=after(3, [0]))
    assert {completion.finish_reason for completion in big} == {"abort"}
    assert max(len(completion.token_ids) for completion in big) < 10
    assert [len(c.token_ids) for c in small] == [50] * 4
