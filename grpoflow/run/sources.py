"""The one place a run chooses how its groups are made: the `Rollout` that plays a step's prompts,
and the `GroupSource` around it (sampled and scored here, scored by Atropos, made a step ahead)."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping
from types import SimpleNamespace
from typing import Any

from torch import nn

from grpoflow import imports
from grpoflow.agents.atropos_client import AtroposClient
from grpoflow.agents.setup import build_episode_runner, environment_rewards
from grpoflow.distributed import DistributedContext
from grpoflow.engines import RolloutEngine
from grpoflow.learn.update import replayed_truncation
from grpoflow.policy import batch_invariant
from grpoflow.policy.placement import Placement
from grpoflow.rewards import RewardRunner
from grpoflow.rollout.agent_programs import AgentPrograms, program_rewards
from grpoflow.rollout.atropos import AtroposGroups
from grpoflow.rollout.groups import Episodes, Rollout, SingleTurn
from grpoflow.rollout.on_policy import OnPolicySingleTurn, Replay, pad_id
from grpoflow.rollout.on_policy_episodes import OnPolicyEpisodes
from grpoflow.rollout.prefetch import PrefetchedGroups
from grpoflow.rollout.prompt_draws import PromptDraws
from grpoflow.rollout.rollout_func import RolloutFunction
from grpoflow.rollout.scoring import SampledGroups
from grpoflow.rollout.source import GroupSource
from grpoflow.run.config import GRPOConfig
from grpoflow.transport.server_client import API_KEY_ENV


def build_rollout(
    config: GRPOConfig,
    tokenizer,
    environment_factory: Callable[[], Any] | Mapping | None,
    *,
    placement: Placement | None = None,
    vocab_size: int | None = None,
    check: str | None = None,
) -> Rollout:
    """What turns a step's prompts into groups: the user's rollout_func when one is named, an agent
    program's episodes (their turns checked against the run's sampling when `check` is "update"),
    episodes of tools or an environment (their turns redrawn by the trainer when `check` is
    "replay", given the placed policy), completions the trainer redraws (likewise), else one
    sampled completion per group member.
    `vocab_size`: the policy's embedding rows, which a rollout function's ids may use;
    `check`: the run's `on_policy_check` as `on_policy_check` resolves it."""
    agent, native = config.agent, config.generation.engine_name == "native"
    if agent.rollout_func is not None:
        return RolloutFunction(
            imports.load_object(agent.rollout_func, "rollout_func"),
            tokenizer,
            SimpleNamespace(**config.to_flat_dict()),
            per_prompt_params=native,
            vocab_size=vocab_size,
        )
    if agent.agent_program is not None:
        return AgentPrograms(
            agent,
            tokenizer,
            model_name=config.policy.model,
            max_model_len=config.generation.engine.max_model_len or config.max_model_len,
            tool_call_parser=agent.tool_call_parser,
            server_api_key=config.remote.vllm_server_api_key or os.environ.get(API_KEY_ENV),
            exact=check == "update",
        )
    runner = build_episode_runner(
        agent,
        tokenizer,
        environment_factory,
        max_completion_length=config.generation.max_completion_length,
        max_prompt_length=config.data.max_prompt_length,
        system=config.data.system,
        per_prompt_params=native,
    )
    replay = None
    if check == "replay" and placement is not None:
        replay = Replay(
            placement,
            micro_batch_size=config.training.micro_batch_size,
            temperature=config.generation.sampling.temperature,
            truncation=replayed_truncation(config.generation.sampling, config.algorithm),
            chunk_size=config.algorithm.logprob_chunk_size,
            pad_id=pad_id(tokenizer),
        )
    if runner is not None:
        return OnPolicyEpisodes(runner, tokenizer, replay) if replay else Episodes(runner, tokenizer)
    if replay is not None:
        return OnPolicySingleTurn(tokenizer, replay)
    return SingleTurn(tokenizer)


def on_policy_check(config: GRPOConfig, model: nn.Module) -> str | None:
    """How the run checks on_policy_sampling's draws: None (not on), "replay" or "update"; auto
    is update where the batch-invariant kernels run on `model`, the engine scores its draws as
    the update does (`batch_invariant.scores_match`) and nothing truncates. update without them is
    refused, and so is replay for an agent program, whose turns arrive too late to redraw."""
    generation = config.generation
    if not generation.on_policy_sampling:
        return None
    invariant = batch_invariant.scores_match(model)
    if generation.on_policy_check == "auto":
        check = "update" if invariant and not generation.sampling.truncation.active else "replay"
        if check == "replay" and config.agent.agent_program is not None:
            raise ValueError(
                "on_policy_sampling with agent_program needs the update's check, and on_policy_check: auto "
                "chose replay here (the batch_invariant line above says whether the kernels run): an agent "
                "program's turns arrive over HTTP after it has acted on them, too late to redraw; set "
                "batch_invariant: true and leave lm_head out of target_modules, or on_policy_sampling: false"
            )
        return check
    if generation.on_policy_check == "update" and not invariant:
        raise ValueError(
            "on_policy_check: update needs the batch-invariant kernels and an output head without an "
            "adapter (the batch_invariant line above says whether the kernels run): set "
            "batch_invariant: true and leave lm_head out of target_modules, or on_policy_check: replay"
        )
    return generation.on_policy_check


def rollout_rewards(
    config: GRPOConfig, environment_factory: Callable[[], Any] | Mapping | None
) -> list[tuple[str, Callable[..., Any]]]:
    """Rewards the rollout brings beside reward_funcs: an environment's `get_reward`, what an
    agent program returns."""
    extra = environment_rewards(environment_factory)
    return extra + program_rewards() if config.agent.agent_program is not None else extra


def build_group_source(
    config: GRPOConfig,
    *,
    rollout: Rollout,
    engine: RolloutEngine,
    placement: Placement,
    rewards: RewardRunner | None,
    items: list,
    tokenizer,
    distributed: DistributedContext,
    vocab_size: int | None = None,
    sleep: bool = True,
) -> GroupSource:
    """Atropos's scored groups when `atropos_url` is set (rows with token ids at or above
    `vocab_size` skipped); else the run's prompts played by `rollout` and scored by `rewards`,
    made a step ahead under `async_generate`."""
    if config.atropos.enabled:
        settings = config.atropos
        size = settings.atropos_batch_size or config.generation_batch_size
        client = AtroposClient(dataclasses.replace(settings, atropos_batch_size=size), vocab_size=vocab_size)
        return AtroposGroups(client, tokenizer)
    assert rewards is not None, "a run that samples its own groups has rewards"
    generation, algorithm = config.generation, config.algorithm
    per_prompt_seeds = engine.capabilities.per_prompt_params
    draws = PromptDraws(
        len(items),
        seed=config.training.seed,
        shuffle=config.data.dataset_shuffle,
        sampling=config.step_sampling(tokenizer.eos_token_id),
        distributed=distributed,
        per_prompt_seeds=per_prompt_seeds,
    )
    sampled = SampledGroups(
        rollout=rollout,
        engine=engine,
        placement=placement,
        rewards=rewards,
        draws=draws,
        items=items,
        dynamic_sample=algorithm.dynamic_sample,
        max_resample_times=algorithm.max_resample_times,
        num_generations=generation.num_generations,
        num_prompts=config.generation_batch_size // generation.num_generations,
        distributed=distributed,
        sleep=sleep,
    )
    if config.off_policy.async_generate:
        return PrefetchedGroups(sampled, config.off_policy.max_staleness)
    return sampled
