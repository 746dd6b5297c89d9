"""Every sampled turn of an agent program's episode is trained, exactly, when later prompts do not
extend it: under Qwen3's real chat template (tests/chat/templates/qwen3.jinja), which renders an
earlier assistant turn without the thinking block its prompt opened, and with a program that
forgets its earlier turns. Played on the native engine hosted in this process."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from helpers import agent_programs  # noqa: E402
from helpers.trained_turns import assert_every_turn_trained  # noqa: E402

from grpoflow.agents.config import AgentConfig  # noqa: E402
from grpoflow.data.prompts import PromptItem  # noqa: E402
from grpoflow.engines import EngineConfig, EngineOptions, SamplingParams, build_engine  # noqa: E402
from grpoflow.policy.tiny import build_char_tokenizer, build_tiny_model  # noqa: E402
from grpoflow.rollout.agent_programs import AgentPrograms  # noqa: E402
from grpoflow.rollout.batch import collate  # noqa: E402

QWEN3_TEMPLATE = Path(__file__).parents[1] / "chat" / "templates" / "qwen3.jinja"
GENERATIONS = 2


@pytest.fixture(scope="module")
def tokenizer():
    """The character tokenizer with Qwen's turn markers as special tokens, `<|im_end|>` its end of
    sequence, and Qwen3's chat template."""
    tokenizer = build_char_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.eos_token = "<|im_end|>"
    tokenizer.chat_template = QWEN3_TEMPLATE.read_text()
    return tokenizer


@pytest.fixture(scope="module")
def engine(tokenizer):
    model = build_tiny_model(
        len(tokenizer), model_type="qwen3", max_position_embeddings=512, eos_token_id=tokenizer.eos_token_id
    ).eval()
    options = EngineOptions(engine=EngineConfig(max_model_len=512, max_num_seqs=8))
    return build_engine("native", model, tokenizer, options)


def play(engine, tokenizer, program: str, rows: list[dict]):
    """One episode of `program` per row (each its own group, `id` naming it); the groups, each
    episode's turns as the server answered the program, and the rollout's metrics."""
    config = AgentConfig(agent_program=f"helpers.agent_programs:{program}", max_turn_tokens=6)
    agent = AgentPrograms(config, tokenizer, model_name="tiny", max_model_len=512)
    items = [PromptItem(prompt=row["question"], prompt_ids=[5, 6], columns=row) for row in rows]
    params = [
        SamplingParams(n=1, max_tokens=200, temperature=1.0, seed=7 + index) for index in range(len(rows))
    ]
    try:
        groups = agent(engine, items, params)
    finally:
        agent.close()
    return groups, [agent_programs.SEEN.pop(row["id"]) for row in rows], agent.last_metrics


def test_qwen3_turns_whose_thinking_the_template_drops_are_each_trained_exactly(engine, tokenizer):
    """Without thinking, Qwen3's generation prompt opens an empty thinking block that the next
    prompt renders the turn without: no turn extends the one before, each is a sequence."""
    no_thinking = {"enable_thinking": False}
    rows = [{"id": f"qwen3-{index}", "question": "hi", "template_kwargs": no_thinking} for index in range(2)]
    groups, turns, metrics = play(engine, tokenizer, "chatty_agent", rows)
    assert all(len(episode) == 3 for episode in turns)
    opened = tokenizer("<think>\n\n</think>\n\n", add_special_tokens=False)["input_ids"]
    assert turns[0][0]["prompt_ids"][-len(opened) :] == opened
    batch = collate(groups, tokenizer.pad_token_id, torch.device("cpu"))
    for row, episode in enumerate(turns):
        assert_every_turn_trained(batch, row, episode)
    assert metrics["episodes/dropped_turns_mean"] == 0 and metrics["episodes/segments_mean"] == 3
    assert metrics["episodes/turns_mean"] == 3 and metrics["episodes/errors"] == 0


def test_a_program_that_forgets_its_first_exchange_has_every_turn_trained_exactly(engine, tokenizer):
    rows = [{"id": f"forget-{index}", "question": "hi"} for index in range(2)]
    groups, turns, metrics = play(engine, tokenizer, "forgetful_agent", rows)
    batch = collate(groups, tokenizer.pad_token_id, torch.device("cpu"))
    for row, episode in enumerate(turns):
        assert len(episode) == 4
        assert_every_turn_trained(batch, row, episode)
        third = episode[2]["prompt_ids"]
        assert third[: len(episode[1]["prompt_ids"])] != episode[1]["prompt_ids"]  # rewritten
    assert metrics["episodes/dropped_turns_mean"] == 0 and metrics["episodes/segments_mean"] >= 2
    assert all(outcome.num_segments >= 2 for group in groups for outcome in group.environments)
