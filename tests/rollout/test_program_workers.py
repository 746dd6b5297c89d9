"""Agent programs in worker processes (`agent_workers`), against the policy's native engine in this
process: the groups are those the programs give in the training process, a program that fails or
hangs ends only its episode, and a worker that dies ends its episodes with an error naming it."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("openai")
pytest.importorskip("fastapi")

from helpers import agent_programs  # noqa: E402

from grpoflow.agents.config import AgentConfig  # noqa: E402
from grpoflow.data.prompts import PromptItem  # noqa: E402
from grpoflow.engines import EngineConfig, EngineOptions, SamplingParams, build_engine  # noqa: E402
from grpoflow.policy.tiny import build_char_tokenizer, build_tiny_model  # noqa: E402
from grpoflow.rollout.agent_programs import AgentPrograms  # noqa: E402


@pytest.fixture(scope="module")
def tokenizer():
    tokenizer = build_char_tokenizer()
    tokenizer.chat_template = agent_programs.TEMPLATE
    return tokenizer


@pytest.fixture(scope="module")
def engine(tokenizer):
    model = build_tiny_model(len(tokenizer), model_type="llama", max_position_embeddings=512).eval()
    return build_engine("native", model, tokenizer, EngineOptions(engine=EngineConfig(max_model_len=512)))


def rollout(tokenizer, workers: int, **options) -> AgentPrograms:
    config = AgentConfig(
        agent_program="helpers.agent_programs:dispatch", max_turn_tokens=6, agent_workers=workers, **options
    )
    return AgentPrograms(config, tokenizer, model_name="tiny", max_model_len=512)


def items(*behaviours: str) -> list[PromptItem]:
    rows = [{"id": f"{name}-{i}", "question": "hi", "behaviour": name} for i, name in enumerate(behaviours)]
    return [PromptItem(prompt=row["question"], prompt_ids=[5, 6], columns=row) for row in rows]


def params(count: int, n: int = 2) -> list[SamplingParams]:
    return [SamplingParams(n=n, max_tokens=60, temperature=1.0, seed=100 + i) for i in range(count)]


@pytest.fixture(scope="module")
def in_workers(tokenizer):
    """Two worker processes, started once for the module's tests (a start takes seconds)."""
    agent = rollout(tokenizer, 2, agent_timeout=1.0)
    yield agent
    agent.close()


def test_workers_play_the_groups_the_training_process_plays_and_failures_end_only_their_episode(
    engine, tokenizer, in_workers
):
    behaviours = ("ok", "rewrite", "raise", "hang", "ok")
    in_process = rollout(tokenizer, 0, agent_timeout=1.0)
    try:
        here = in_process(engine, items(*behaviours), params(len(behaviours)))
    finally:
        in_process.close()
    there = in_workers(engine, items(*behaviours), params(len(behaviours)))
    assert in_workers.hosted is None and in_workers.worker_processes is not None
    for agent in (in_process, in_workers):
        assert agent.last_metrics["episodes/ended_by/timeout"] == pytest.approx(2 / 10)
        assert agent.last_metrics["episodes/ended_by/error"] == pytest.approx(2 / 10)
    for mine, theirs in zip(here, there, strict=True):
        assert (mine.item.prompt_ids, mine.sequence_starts) == (
            theirs.item.prompt_ids,
            theirs.sequence_starts,
        )
        for a, b in zip(mine.completions, theirs.completions, strict=True):
            assert (a.token_ids, a.mask, a.finish_reason) == (b.token_ids, b.mask, b.finish_reason)
            torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs))
        for a, b in zip(mine.environments, theirs.environments, strict=True):
            assert (a.reward, a.ending, a.error, a.row) == (b.reward, b.ending, b.error, b.row)
    assert sum(len(c.token_ids) for group in there for c in group.completions) > 20


def test_a_worker_that_dies_ends_its_episodes_with_an_error_naming_it_and_starts_again(
    engine, in_workers, caplog
):
    # dealt in turn: worker 0 plays the first and third episodes, worker 1 the second
    groups = in_workers(engine, items("ok", "die", "ok"), params(3, n=1))
    assert [group.environments[0].ending for group in groups] == ["stop", "error", "stop"]
    error = groups[1].environments[0].error
    assert "agent worker 1 (pid" in error and "killed by signal 9" in error
    assert "agent worker 1" in caplog.text
    again = in_workers(engine, items("ok", "ok"), params(2, n=1))
    assert [group.environments[0].ending for group in again] == ["stop", "stop"]


def test_a_worker_whose_program_blocks_it_past_its_deadline_is_killed(engine, in_workers):
    in_workers.worker_processes.slack_s = 0.5
    try:
        ok, blocked = in_workers(engine, items("ok", "block"), params(2, n=1))
    finally:
        in_workers.worker_processes.slack_s = 60.0
    assert ok.environments[0].ending == "stop" and blocked.environments[0].ending == "error"
    assert "agent worker 1" in blocked.environments[0].error
    assert "did not answer within agent_timeout" in blocked.environments[0].error
    assert in_workers.last_metrics["time/agent"] < 10
