"""How an agent program's chat requests are rewritten to the run's sampling, turn by turn."""

from __future__ import annotations

import json

import pytest

httpx = pytest.importorskip("httpx")

from grpoflow.agents.program_client import EpisodeBudget, RunSampling  # noqa: E402

SAMPLING = RunSampling(
    temperature=0.7,
    top_p=0.9,
    top_k=20,
    min_p=0.0,
    repetition_penalty=1.0,
    max_completion_length=30,
    max_turn_tokens=8,
)


def answered(budget: EpisodeBudget, prompt_tokens: int, completion_tokens: int) -> None:
    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens}
    budget.record(200, json.dumps({"usage": usage}).encode())


def test_the_runs_distribution_replaces_the_programs_and_its_own_fields_stay():
    budget = EpisodeBudget(SAMPLING, seed=5)
    body = {"messages": [], "tools": [{"x": 1}], "temperature": 0.0, "top_p": 0.1, "stop": ["\n"], "seed": 1}
    rewritten = budget.rewrite(body)
    assert {
        name: rewritten[name] for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
    } == {
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": 20,
        "min_p": 0.0,
        "repetition_penalty": 1.0,
    }
    assert rewritten["tools"] == [{"x": 1}] and rewritten["stop"] == ["\n"]
    assert rewritten["max_tokens"] == 8  # max_turn_tokens
    assert rewritten["seed"] == 5 * 1_000_003 % 2**62
    answered(budget, 10, 4)
    assert budget.rewrite(body)["seed"] == (5 * 1_000_003 + 1) % 2**62  # a seed per turn


def test_max_tokens_is_the_smallest_of_the_programs_the_turn_limit_and_what_the_episode_has_left():
    budget = EpisodeBudget(SAMPLING)
    assert budget.rewrite({"max_completion_tokens": 3})["max_tokens"] == 3
    assert "max_completion_tokens" not in budget.rewrite({"max_completion_tokens": 3})
    assert budget.rewrite({"max_tokens": 50})["max_tokens"] == 8
    answered(budget, 10, 8)
    answered(budget, 10 + 8 + 7, 8)  # used: 7 inserted + 2 x 8 sampled = 23 of 30
    assert budget.used == 23 and budget.rewrite({})["max_tokens"] == 7
    assert "seed" not in budget.rewrite({})  # an unseeded run draws from the engine


def test_a_request_past_the_budget_or_after_the_end_is_refused():
    budget = EpisodeBudget(SAMPLING)
    answered(budget, 10, 30)
    assert "used its max_completion_length=30" in budget.rewrite({}) and budget.exhausted
    budget.closed = True
    assert "this episode has ended" in budget.rewrite({})


def test_failed_answers_are_not_counted_and_a_full_context_spends_the_budget():
    budget = EpisodeBudget(SAMPLING)
    budget.record(400, b'{"error": {"param": "messages"}}')
    budget.record(200, b"not json")
    assert budget.turns == 0 and budget.used == 0 and not budget.exhausted
    budget.record(400, b'{"error": {"message": "exceed this model\'s context", "param": "max_tokens"}}')
    assert budget.exhausted and budget.turns == 0
