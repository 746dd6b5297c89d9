"""Environment episodes sampled on-policy by construction (CPU, float32): an engine whose model
differs from the trainer's only proposes each turn; the episodes come out as the trainer's own
draws, and a run trains with no gap between the engine's log-probs and the update's."""

from __future__ import annotations

import torch
from helpers.native_fixtures import perturbed
from helpers.support import recipe

from grpoflow.agents.config import AgentConfig
from grpoflow.agents.episode_runner import EpisodeRunner
from grpoflow.algo.truncation import Truncation
from grpoflow.data.prompts import PromptItem
from grpoflow.engines import EngineConfig, EngineOptions, SamplingParams, build_engine
from grpoflow.policy.placement import Placement
from grpoflow.policy.tiny import build_char_tokenizer, build_tiny_model
from grpoflow.rollout.groups import episode_groups
from grpoflow.rollout.on_policy import Replay
from grpoflow.rollout.on_policy_episodes import OnPolicyEpisodes
from grpoflow.run.build import run
from grpoflow.tasks.relay import RelayEnvironment


class Greeting(RelayEnvironment):
    """Relay whose reset text differs per episode: the episodes of a prompt start differently."""

    count = 0

    def reset(self, letters: str, **row) -> str:
        super().reset(letters)
        Greeting.count += 1
        return f" {'ab'[Greeting.count % 2]}"


def play(tokenizer, model, policy, truncation=None):
    engine = build_engine("native", model, tokenizer, EngineOptions(engine=EngineConfig(max_model_len=64)))
    runner = EpisodeRunner(
        AgentConfig(environment_factory="unused", max_turn_tokens=4, max_turns=3),
        tokenizer,
        environment_factory=Greeting,
        max_completion_length=30,
        per_prompt_params=True,
    )
    replay = Replay(Placement(module=policy, device=torch.device("cpu")), 3, 1.0, truncation)
    rollout = OnPolicyEpisodes(runner, tokenizer, replay)
    items = [PromptItem(f"echo {c}:", tokenizer.encode(f"echo {c}:"), {"letters": c + "bc"}) for c in "ad"]
    Greeting.count = 0
    params = [SamplingParams(n=3, seed=seed, temperature=1.0, top_k=30) for seed in (1, 2)]
    return rollout, rollout(engine, items, params)


def test_episodes_are_the_trainers_own_draws_whatever_the_engine_proposes():
    tokenizer = build_char_tokenizer()
    policy = build_tiny_model(len(tokenizer), seed=0)
    truncation = Truncation(top_k=30)
    _, expected = play(tokenizer, policy, policy, truncation)
    rollout, groups = play(tokenizer, perturbed(policy, 0.3), policy, truncation)
    assert rollout.last_metrics["on_policy/replaced_tokens"] > 0
    assert rollout.last_metrics["on_policy/unconfirmed_tokens"] == 0
    for ours, theirs in zip(groups, expected):
        assert ours.item.prompt_ids == theirs.item.prompt_ids
        assert [c.token_ids for c in ours.completions] == [c.token_ids for c in theirs.completions]
        assert [c.logprobs for c in ours.completions] == [c.logprobs for c in theirs.completions]


def test_episodes_whose_reset_text_differs_train_on_the_prompt_each_was_sampled_from():
    tokenizer = build_char_tokenizer()
    policy = build_tiny_model(len(tokenizer), seed=0)
    runner = EpisodeRunner(
        AgentConfig(environment_factory="unused", max_turn_tokens=4, max_turns=2),
        tokenizer,
        environment_factory=Greeting,
        max_completion_length=30,
        per_prompt_params=True,
    )
    engine = build_engine("native", policy, tokenizer, EngineOptions(engine=EngineConfig(max_model_len=64)))
    items = [PromptItem("echo a:", tokenizer.encode("echo a:"), {"letters": "abc"})]
    (members,) = runner.run(engine, items, [SamplingParams(n=2, seed=1)])
    assert members[0].prompt_ids != members[1].prompt_ids
    (group,) = episode_groups(tokenizer, [members])
    for episode, completion in zip(members, group.completions):
        assert group.item.prompt_ids + completion.token_ids == episode.prompt_ids + episode.ids
        assert sum(completion.loss_mask) == sum(episode.mask)


def test_a_run_of_environment_episodes_with_on_policy_sampling_trains_with_no_gap(tmp_path):
    config = recipe(
        tmp_path, max_steps=2, on_policy_sampling=True, dataset="relay",
        environment_factory="grpoflow.tasks.relay:RelayEnvironment", max_turns=3, max_turn_tokens=4,
        max_prompt_length=16, max_completion_length=24, top_p=0.9,
    )  # fmt: skip
    history = run(config)
    for step in history:
        assert step["episodes/turns_mean"] > 1
        assert step["on_policy/unconfirmed_tokens"] == 0 and step["on_policy/unchecked_tokens"] == 0
        assert step["sampling/sampling_logp_difference/max"] == 0


def test_environment_episodes_on_the_batch_invariant_kernels_pass_the_updates_check(tmp_path):
    """Each turn is decoded after the episode so far (the prefix cache's pages), the update's
    forward runs the whole episode at once: the same logits, every token's log-prob equal."""
    config = recipe(
        tmp_path, max_steps=2, on_policy_sampling=True, batch_invariant=True, torch_dtype="bfloat16",
        dataset="relay", environment_factory="grpoflow.tasks.relay:RelayEnvironment", max_turns=3,
        max_turn_tokens=4, max_prompt_length=16, max_completion_length=24,
    )  # fmt: skip
    for step in run(config):
        assert step["episodes/turns_mean"] > 1 and "on_policy/unconfirmed_tokens" not in step
        assert step["on_policy/unverified_fraction"] == 0
        assert step["sampling/sampling_logp_difference/max"] == 0
