"""Requests that join a running native `generate` call through its intake: they get rows in turn
with the call's own, are handed their completions as soon as their sequences finish, and draw
what they would draw alone."""

from __future__ import annotations

import functools

import pytest
from helpers.native_fixtures import one_thread, tiny  # noqa: F401 (a fixture)

from grpoflow.engines.base import SamplingParams
from grpoflow.engines.native import NativeEngine, NativeEngineConfig

LONG = SamplingParams(n=32, max_tokens=16, ignore_eos=True)
"""32 sequences over 4 rows: 8 waves of 16 steps."""


@pytest.fixture(scope="module")
def model():
    return tiny("qwen2")


def engine_for(model, **config) -> NativeEngine:
    config = {"max_num_seqs": 4, "num_kv_blocks": 256, **config}
    engine = NativeEngine(model, config=NativeEngineConfig(**config))
    engine.wake_up()
    return engine


class Intake:
    """Hands `requests` at its `at`-th call; records at which call each sink was called."""

    def __init__(self, at: int, *requests) -> None:
        self.at, self.requests, self.calls = at, list(requests), 0
        self.answers: list[tuple[int, list]] = []

    def __call__(self):
        self.calls += 1
        if self.calls != self.at:
            return []
        return [(prompts, [params] * len(prompts), self.sink) for prompts, params in self.requests]

    def sink(self, groups) -> None:
        self.answers.append((self.calls, groups))


@pytest.mark.parametrize(("generic", "answered_by", "calls"), [(False, 40, 120), (True, 4, 9)])
def test_a_joining_request_is_answered_long_before_the_call_ends(model, generic, answered_by, calls):
    """The joining request takes the next free row (the family path's intake runs between steps:
    when the first wave ends; the generic path's between chunks: in the next chunk), not one after
    the 28 sequences still waiting, and is answered then, while the call runs on."""
    engine = engine_for(model, force_generic=generic)
    intake = Intake(3, ([[3, 4]], SamplingParams(max_tokens=1)))
    (group,) = engine.generate([[5, 6, 7]], LONG, intake=intake)
    ((answered_at, answer),) = intake.answers
    assert [len(c.token_ids) for c in group] == [16] * 32 and len(answer[0][0].token_ids) == 1
    assert answered_at <= answered_by and intake.calls >= calls
    assert engine.stats.num_generated_tokens == 32 * 16 + 1


def test_a_seeded_request_draws_the_same_whether_it_joined_or_ran_alone(model):
    engine = engine_for(model)
    seeded = SamplingParams(n=3, max_tokens=6, temperature=1.0, seed=5)
    intake = Intake(5, ([[3, 4], [9]], seeded))
    engine.generate([[5, 6, 7]], SamplingParams(n=8, max_tokens=20, temperature=1.0), intake=intake)
    ((_, joined),) = intake.answers
    alone = engine.generate([[3, 4], [9]], seeded)
    assert [[c.token_ids for c in group] for group in joined] == [
        [c.token_ids for c in group] for group in alone
    ]


def test_a_call_of_joining_requests_only_takes_its_distribution_from_params(model):
    engine = engine_for(model)
    intake = Intake(
        1, ([[3, 4]], SamplingParams(n=2, max_tokens=4)), ([[0, 99]], SamplingParams(max_tokens=4))
    )
    assert engine.generate([], SamplingParams(), on_error="error_completion", intake=intake) == []
    ((_, good), (_, bad)) = sorted(intake.answers, key=lambda answer: len(answer[1][0]), reverse=True)
    assert [len(c.token_ids) for c in good[0]] == [4, 4]
    assert bad[0][0].finish_reason == "error" and "outside" in bad[0][0].text


def test_a_joining_request_must_share_the_call_distribution(model):
    engine = engine_for(model)
    intake = Intake(2, ([[3, 4]], SamplingParams(max_tokens=2, temperature=0.5)))
    with pytest.raises(ValueError, match="must share its temperature"):
        engine.generate([[5, 6, 7]], SamplingParams(max_tokens=8), intake=intake)


def test_a_request_that_finds_every_row_held_takes_one_from_the_long_request(model):
    """Every row is the long request's, each for 16 steps: the joining request has one of them
    (preempted) at once, and is answered a step or two later; the long request still ends whole."""
    engine = engine_for(model)
    intake = Intake(3, ([[3, 4]], SamplingParams(max_tokens=2)))
    (group,) = engine.generate([[5, 6, 7]], LONG, intake=intake)
    ((answered_at, answer),) = intake.answers
    assert answered_at <= 8 and len(answer[0][0].token_ids) == 2
    assert [len(c.token_ids) for c in group] == [16] * 32 and engine.stats.extra["preemptions"] >= 1


class Trickle:
    """Hands one request of one sequence at each of its calls from `first` on, `count` in all."""

    def __init__(self, first: int, count: int, params: SamplingParams) -> None:
        self.first, self.count, self.params, self.calls = first, count, params, 0
        self.answers: list[tuple[int, list]] = []

    def __call__(self):
        self.calls += 1
        index = self.calls - self.first
        if not 0 <= index < self.count:
            return []
        return [([[3 + index, 4]], [self.params], functools.partial(self.sink, index))]

    def sink(self, index: int, groups) -> None:
        self.answers.append((index, groups))


@pytest.mark.parametrize(("wait_steps", "prefills"), [(0, 9), (8, 5)])
def test_requests_arriving_one_by_one_share_prefill_steps(model, wait_steps, prefills):
    """16 rows (a prefill is worth 2 sequences): 8 requests joining one a step each are prefilled
    one by one without waiting, in pairs when each may wait for the next; their draws are the same."""
    engine = engine_for(model, max_num_seqs=16, prefill_wait_steps=wait_steps)
    joining = SamplingParams(max_tokens=3, temperature=1.0, seed=7)
    trickle = Trickle(3, 8, joining)
    engine.generate(
        [[5, 6, 7]], SamplingParams(max_tokens=40, ignore_eos=True, temperature=1.0), intake=trickle
    )
    assert len(trickle.answers) == 8
    assert engine.stats.extra["prefill_steps"] == prefills
    alone = engine.generate([[3 + index, 4] for index in range(8)], joining)
    joined = [groups[0] for _, groups in sorted(trickle.answers, key=lambda answer: answer[0])]
    assert [[c.token_ids for c in group] for group in joined] == [
        [c.token_ids for c in group] for group in alone
    ]


def test_a_lone_joining_request_waits_at_most_prefill_wait_steps(model):
    engine = engine_for(model, max_num_seqs=16, prefill_wait_steps=6)
    intake = Intake(3, ([[3, 4]], SamplingParams(max_tokens=1)))
    engine.generate([[5, 6, 7]], SamplingParams(max_tokens=40, ignore_eos=True), intake=intake)
    ((answered_at, _),) = intake.answers
    assert 3 + 6 <= answered_at <= 3 + 6 + 4
