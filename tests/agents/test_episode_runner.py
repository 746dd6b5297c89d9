"""Episodes end to end on the CPU: a chat tokenizer with tools, environments that answer, fail or
hang, and the token ids the engine saw, exactly."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from helpers.environments import Shout

from grpoflow.agents.config import AgentConfig
from grpoflow.agents.episode_runner import EpisodeRunner
from grpoflow.agents.render import TurnRenderer
from grpoflow.algo import policy_loss
from grpoflow.data.prompts import PromptItem, encode_prompt
from grpoflow.engines import (
    Completion,
    EngineCapabilities,
    EngineConfig,
    EngineOptions,
    EngineStats,
    SamplingParams,
    build_engine,
)
from grpoflow.policy.tiny import build_char_tokenizer, build_tiny_model
from grpoflow.rollout.batch import collate
from grpoflow.rollout.groups import episode_groups
from grpoflow.tasks.relay import RelayEnvironment

CHAT_TEMPLATE = (
    "{%- if tools %}<|system|>tools:{% for t in tools %} {{ t.function.name }}{% endfor %}<eos>\n{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' %}<|assistant|>{{ m.content }}"
    "{%- if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>{{ c.function.name }}</tool_call>{% endfor %}{% endif %}"
    "{{ '<eos>\n' }}"
    "{%- else %}<|{{ m.role }}|>{{ m.content }}{{ '<eos>\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|assistant|>{%- endif %}"
)
CALL_ADD = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'


@pytest.fixture
def tokenizer():
    tokenizer = build_char_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


class ScriptedEngine:
    """Our engine interface answering from a script: `reply(prompt_text) -> text`; records every prompt."""

    capabilities = EngineCapabilities(name="scripted")
    shares_policy_weights, policy_version, stats = True, 0, EngineStats()

    def __init__(self, tokenizer, reply):
        self.tokenizer, self.reply, self.prompts = tokenizer, reply, []

    def generate(self, prompts, params):
        out = []
        for prompt in prompts:
            self.prompts.append(list(prompt))
            ids = self.tokenizer.encode(self.reply(self.tokenizer.decode(prompt)), add_special_tokens=False)
            ids = [*ids, self.tokenizer.eos_token_id][
                : (params[0] if isinstance(params, list) else params).max_tokens
            ]
            out.append([Completion(ids, [-0.5] * len(ids), "stop")])
        return out


class Calculator:
    """A TRL-style environment: public methods are tools, get_reward scores the episode."""

    def reset(self, **row):
        self.calls = 0

    def add(self, a: int, b: int) -> int:
        """Add two integers.

        Args:
            a: The first.
            b: The second.
        """
        self.calls += 1
        return a + b

    def get_reward(self) -> float:
        return float(self.calls)


def chat_item(tokenizer, text="What is 2 + 3?"):
    prompt = [{"role": "user", "content": text}]
    return PromptItem(prompt, encode_prompt(tokenizer, prompt, None))


def runner(tokenizer, factory=None, tools=(), **limits):
    config = AgentConfig(environment_factory="unused", **limits)
    return EpisodeRunner(
        config, tokenizer, tools=tools, environment_factory=factory, max_completion_length=1024
    )


def test_a_tool_episode_is_the_exact_ids_the_engine_saw_with_the_tool_result_masked(tokenizer):
    engine = ScriptedEngine(tokenizer, lambda prompt: "It is 5." if "<|tool|>" in prompt else CALL_ADD)
    run = runner(tokenizer, Calculator)
    ((episode,),) = run.run(engine, [chat_item(tokenizer)], SamplingParams(n=1))
    assert episode.finish == "stop" and episode.turns == 2 and episode.tool_calls == 1
    assert [m["role"] for m in episode.messages] == ["assistant", "tool", "assistant"]
    assert episode.messages[1] == {"role": "tool", "name": "add", "content": "5"}
    assert not any(key.startswith("rollout/") for key in run.last_metrics)  # no engine stats
    first, second = engine.prompts
    assert (
        first == episode.prompt_ids and second == episode.prompt_ids + episode.ids[: len(second) - len(first)]
    )
    assert "tools: add" in tokenizer.decode(first)  # the environment's tool is rendered into the prompt
    turn_one = len(tokenizer.encode(CALL_ADD)) + 1
    suffix = TurnRenderer(tokenizer).suffix_ids([episode.messages[1]], ended_turn=True)
    assert episode.ids[turn_one : turn_one + len(suffix)] == suffix
    assert tokenizer.decode(suffix) == "\n<|tool|>5<eos>\n<|assistant|>"
    assert episode.mask == [1] * turn_one + [0] * len(suffix) + [1] * (
        len(episode.ids) - turn_one - len(suffix)
    )
    assert episode.logprobs[turn_one : turn_one + len(suffix)] == [0.0] * len(suffix)
    assert episode.environment.get_reward() == 1.0


def test_a_malformed_call_is_answered_and_the_episode_goes_on(tokenizer):
    replies = iter(["<tool_call>{oops}</tool_call>", "Sorry, done."])
    engine = ScriptedEngine(tokenizer, lambda prompt: next(replies))
    ((episode,),) = runner(tokenizer, Calculator).run(engine, [chat_item(tokenizer)], SamplingParams(n=1))
    assert episode.finish == "stop" and episode.tool_errors == 1
    assert "not valid JSON" in episode.messages[1]["content"]


def test_limits_end_episodes_and_are_counted(tokenizer):
    always_calls = ScriptedEngine(tokenizer, lambda prompt: CALL_ADD)
    run = runner(tokenizer, Calculator, max_tool_calling_iterations=2)
    ((episode,),) = run.run(always_calls, [chat_item(tokenizer)], SamplingParams(n=1))
    assert episode.finish == "max_tool_calling_iterations" and episode.tool_turns == 2 and episode.turns == 3
    assert run.last_metrics["episodes/ended_by/max_tool_calling_iterations"] == 1.0
    ((episode,),) = runner(tokenizer, Calculator, max_turns=2).run(
        always_calls, [chat_item(tokenizer)], SamplingParams(n=1)
    )
    assert episode.finish == "max_turns" and episode.turns == 2


class Flaky(RelayEnvironment):
    """Fails in reset, in respond, or hangs, depending on the row."""

    def reset(self, letters, mode, **row):
        if mode == "reset":
            raise RuntimeError("no sandbox")
        super().reset(letters)
        self.mode = mode

    def respond(self, text):
        if self.mode == "respond":
            raise ValueError("lost state")
        if self.mode == "hang":
            time.sleep(3)
        return super().respond(text)


def test_a_failing_or_hanging_environment_ends_only_its_own_episode(tokenizer):
    plain = build_char_tokenizer()
    items = [
        PromptItem("echo a:", plain.encode("echo a:"), {"letters": "abc", "mode": mode})
        for mode in ("reset", "respond", "hang", "ok")
    ]
    engine = ScriptedEngine(plain, lambda prompt: "aaaa")
    run = EpisodeRunner(
        AgentConfig(environment_factory="unused", environment_timeout=0.5, max_turn_tokens=4),
        plain,
        environment_factory=Flaky,
        max_completion_length=64,
    )
    started = time.perf_counter()
    groups = run.run(engine, items, SamplingParams(n=1))
    assert time.perf_counter() - started < 2.5
    reset, respond, hang, ok = (group[0] for group in groups)
    assert (reset.finish, respond.finish, hang.finish, ok.finish) == ("error", "error", "error", "stop")
    assert (
        "no sandbox" in reset.error
        and "lost state" in respond.error
        and "environment_timeout=0.5" in hang.error
    )
    assert ok.turns == 3 and ok.environment.get_reward() == pytest.approx(1 / 3)
    assert [c.finish_reason for c in episode_groups(plain, groups)[0].completions] == ["error"]


RELEASE = threading.Event()


class Hangs(RelayEnvironment):
    """Answers no turn until released: every `respond` hangs past the timeout."""

    def respond(self, text):
        RELEASE.wait(60)
        return super().respond(text)


def test_a_hanging_environment_keeps_the_thread_count_flat_over_50_steps():
    """Each step's hung calls once left a thread each behind (1,285 threads after 40 steps); the
    calls run in `environment_workers` threads, and those that wait past the timeout never run."""
    plain = build_char_tokenizer()
    items = [PromptItem("echo a:", plain.encode("echo a:"), {"letters": "abc"}) for _ in range(4)]
    run = EpisodeRunner(
        AgentConfig(
            environment_factory="unused", environment_timeout=0.02, max_turn_tokens=4, environment_workers=6
        ),
        plain,
        environment_factory=Hangs,
        max_completion_length=64,
    )
    engine = ScriptedEngine(plain, lambda prompt: "aaaa")
    RELEASE.clear()
    before = threading.active_count()
    try:
        for _ in range(50):
            groups = run.run(engine, items, SamplingParams(n=1))
            assert all(group[0].finish == "error" for group in groups)
        assert threading.active_count() <= before + 6
        assert run.workers.num_threads == 6
    finally:
        RELEASE.set()


def test_with_the_real_engine_every_turn_prompt_is_the_trajectory_so_far_and_env_tokens_get_no_gradient():
    tokenizer = build_char_tokenizer()
    model = build_tiny_model(len(tokenizer), seed=0)
    engine = build_engine("native", model, tokenizer, EngineOptions(engine=EngineConfig(max_model_len=64)))
    seen = []
    generate = engine.generate

    def recording(prompts, params):
        seen.extend(list(p) for p in prompts)
        return generate(prompts, params)

    engine.generate = recording
    config = AgentConfig(environment_factory="unused", max_turn_tokens=4, max_turns=4)
    run = EpisodeRunner(
        config,
        tokenizer,
        environment_factory=RelayEnvironment,
        max_completion_length=40,
        per_prompt_params=True,
    )
    items = [PromptItem(f"echo {c}:", tokenizer.encode(f"echo {c}:"), {"letters": c + "bc"}) for c in "ad"]
    groups = run.run(engine, items, [SamplingParams(n=2, seed=s, temperature=1.0) for s in (1, 2)])
    episodes = [episode for group in groups for episode in group]
    assert all(episode.turns == 3 and episode.finish == "stop" for episode in episodes)
    # each turn's prompt is prefilled or read from the prefix cache, token for token
    metrics = run.last_metrics
    assert metrics["rollout/prefill_tokens"] + metrics["rollout/prefix_cache_hit_tokens"] == len(
        sum(seen, [])
    )
    for episode in episodes:  # every prompt the engine saw is a prefix of the episode's final sequence
        full = episode.prompt_ids + episode.ids
        assert len({tuple(prompt) for prompt in seen if prompt == full[: len(prompt)]}) == 3
    batch = collate(episode_groups(tokenizer, groups), tokenizer.pad_token_id, torch.device("cpu"))
    assert torch.equal(batch.loss_mask[0, : len(episodes[0].mask)], torch.tensor(episodes[0].mask))
    logps = torch.randn(batch.completion_ids.shape, requires_grad=True)
    loss, _ = policy_loss(logps, None, torch.ones(len(batch)), batch.loss_mask)
    loss.backward()
    inserted = (batch.completion_mask == 1) & (batch.loss_mask == 0)
    assert inserted.any() and torch.all(logps.grad[inserted] == 0)
    assert torch.all(logps.grad[batch.loss_mask == 1] != 0)


def test_a_prompt_that_outgrows_max_prompt_length_with_its_tools_skips_its_episode(tokenizer):
    engine = ScriptedEngine(tokenizer, lambda prompt: "done")
    run = EpisodeRunner(
        AgentConfig(environment_factory="unused"),
        tokenizer,
        environment_factory=Calculator,
        max_completion_length=64,
        max_prompt_length=10,
    )
    ((episode,),) = run.run(engine, [chat_item(tokenizer)], SamplingParams(n=1))
    assert episode.finish == "error" and "raise max_prompt_length" in episode.error
    assert engine.prompts == []


def test_llama3_json_tool_calls_are_answered_too(tokenizer):
    call = '{"name": "add", "parameters": {"a": 4, "b": 5}}'
    engine = ScriptedEngine(tokenizer, lambda prompt: "Nine." if "<|tool|>" in prompt else call)
    run = runner(tokenizer, Calculator, tool_call_parser="llama3_json")
    ((episode,),) = run.run(engine, [chat_item(tokenizer)], SamplingParams(n=1))
    assert episode.finish == "stop" and episode.messages[1]["content"] == "9"
    assert run.last_metrics["episodes/tool_calls_mean"] == 1.0


def test_each_rows_environment_column_picks_its_class_and_an_unknown_name_skips_only_its_row():
    plain = build_char_tokenizer()
    rows = [
        {"environment": "relay", "letters": "ab"},
        {"environment": "shout", "x": 1},
        {"environment": "gone"},
    ]
    items = [PromptItem("echo a:", plain.encode("echo a:"), row) for row in rows]
    run = EpisodeRunner(
        AgentConfig(environment_factory={"relay": "unused", "shout": "unused"}, max_turn_tokens=4),
        plain,
        environment_factory={"relay": RelayEnvironment, "shout": Shout},
        max_completion_length=64,
    )
    relay, shout, gone = (
        group[0] for group in run.run(ScriptedEngine(plain, lambda p: "aaaa"), items, SamplingParams(n=1))
    )
    assert type(relay.environment) is RelayEnvironment and relay.turns == 2 and relay.finish == "stop"
    assert (
        type(shout.environment) is Shout
        and shout.turns == 2
        and shout.environment.row == {"x": 1, "prompt": "echo a:"}
    )
    assert (
        gone.finish == "error"
        and "'gone', not one of the names in environment_factory ('relay', 'shout')" in gone.error
    )
    assert run.last_metrics["episodes/ended_by/error"] == pytest.approx(1 / 3)
