"""An agent section turned into what a run uses: the episode runner and the environment's reward."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from grpoflow import imports
from grpoflow.agents.config import AgentConfig
from grpoflow.agents.runner import EpisodeRunner
from grpoflow.agents.tools import environment_tools, resolve_tools


def load_environment_factory(spec: str | None) -> Callable[[], Any] | None:
    """The class (or factory function) `environment_factory` names."""
    if spec is None:
        return None
    factory = imports.load_object(spec, "Environment")
    if not callable(factory):
        raise ValueError(
            f"environment_factory {spec!r} is a {type(factory).__name__}, not a class or function"
        )
    if inspect.isclass(factory) and not callable(getattr(factory, "reset", None)):
        raise ValueError(
            f"environment_factory {spec!r}: {factory.__name__} has no reset method; an environment needs "
            "reset(**row), called at the start of each episode (it may return text added to the prompt)"
        )
    return factory


def environment_rewards(factory: Callable[[], Any] | None) -> list[tuple[str, Callable[..., Any]]]:
    """The reward of an environment class with `get_reward`, named after the class (TRL's rule):
    each episode's environment scores it."""
    if not inspect.isclass(factory) or not callable(getattr(factory, "get_reward", None)):
        return []
    environment_class = factory

    def environment_reward(completions: list, environments: list, **kwargs: Any) -> list[float | None]:
        return [
            environment.get_reward() if isinstance(environment, environment_class) else None
            for environment in environments
        ]

    return [(environment_class.__name__, environment_reward)]


def build_episode_runner(
    config: AgentConfig,
    tokenizer,
    factory: Callable[[], Any] | None,
    *,
    max_completion_length: int,
    max_prompt_length: int | None,
    system: str | None,
    per_prompt_params: bool,
) -> EpisodeRunner | None:
    """The episode runner of an agent section; None when it sets neither tools nor an environment."""
    if not config.enabled:
        return None
    tools = resolve_tools(config.tools)
    has_tools = bool(tools) or (inspect.isclass(factory) and bool(environment_tools(factory)))
    if has_tools and not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            "tools are shown to the model by its chat template, and this tokenizer has none: use a chat "
            "model (e.g. a Qwen2.5-Instruct), or an environment that answers through respond(text)"
        )
    return EpisodeRunner(
        config,
        tokenizer,
        tools=tools,
        environment_factory=factory,
        max_completion_length=max_completion_length,
        max_prompt_length=max_prompt_length,
        system=system,
        per_prompt_params=per_prompt_params,
    )
