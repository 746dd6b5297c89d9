"""An agent section turned into what a run uses: the episode runner and the environment's reward."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from grpoflow import imports
from grpoflow.agents.config import AgentConfig
from grpoflow.agents.episode_runner import EpisodeRunner, environment_factories
from grpoflow.agents.tools import environment_tools, resolve_tools
from grpoflow.tasks import library_environment


def agent_environment(config: AgentConfig) -> Callable[[], Any] | dict[str, Callable[[], Any]] | None:
    """What plays an episode's environment: the class of the library environment `environment`
    names, else what `environment_factory` names (see `load_environment_factory`)."""
    if config.environment is not None:
        return library_environment(config.environment)
    return load_environment_factory(config.environment_factory)


def load_environment_factory(
    spec: str | Mapping[str, str] | None,
) -> Callable[[], Any] | dict[str, Callable[[], Any]] | None:
    """The class (or factory function) `environment_factory` names, or for a mapping of names
    to import paths, the mapping of names to classes."""
    if spec is None:
        return None
    if isinstance(spec, Mapping):
        return {name: _load_one(path, f"environment_factory[{name!r}]") for name, path in spec.items()}
    return _load_one(spec, "environment_factory")


def _load_one(spec: str, option: str) -> Callable[[], Any]:
    factory = imports.load_object(spec, "Environment")
    if not callable(factory):
        raise ValueError(f"{option} {spec!r} is a {type(factory).__name__}, not a class or function")
    if inspect.isclass(factory) and not callable(getattr(factory, "reset", None)):
        raise ValueError(
            f"{option} {spec!r}: {factory.__name__} has no reset method; an environment needs "
            "reset(**row), called at the start of each episode (it may return text added to the prompt)"
        )
    return factory


def environment_rewards(
    factory: Callable[[], Any] | Mapping | None,
) -> list[tuple[str, Callable[..., Any]]]:
    """One reward per environment class with `get_reward`, named after the class (TRL's rule):
    it scores the episodes played in exactly that class and gives None for the others (so two
    names for one class score once, and a subclass is not scored by its parent's reward)."""
    classes = dict.fromkeys(
        factory
        for factory in (environment_factories(factory) or {}).values()
        if inspect.isclass(factory) and callable(getattr(factory, "get_reward", None))
    )
    rewards: dict[str, Callable[..., Any]] = {}
    for environment_class in classes:
        name = environment_class.__name__
        if name in rewards:
            raise ValueError(
                f"two environment classes are named {name!r}; their rewards are named after the class, "
                "so rename one of them"
            )
        rewards[name] = _class_reward(environment_class)
    return list(rewards.items())


def _class_reward(environment_class: type) -> Callable[..., Any]:
    def environment_reward(completions: list, environments: list, **kwargs: Any) -> list[float | None]:
        return [
            environment.get_reward() if type(environment) is environment_class else None
            for environment in environments
        ]

    return environment_reward


def build_episode_runner(
    config: AgentConfig,
    tokenizer,
    factory: Callable[[], Any] | Mapping | None,
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
    if not getattr(tokenizer, "chat_template", None):
        _check_no_tools(tools, (environment_factories(factory) or {}).values())
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


def _check_no_tools(tools: list[Callable[..., Any]], classes: Iterable[Any]) -> None:
    """Refuse tools for a tokenizer with no chat template, naming each one and where it comes from."""
    causes = [f"tools {', '.join(tool.__name__ for tool in tools)}"] if tools else []
    for cls in classes:
        methods = environment_tools(cls) if inspect.isclass(cls) else []
        if methods:
            names = ", ".join(method.__name__ for method in methods)
            causes.append(
                f"{cls.__name__}'s public methods {names} (an environment's public methods other than "
                "reset, respond and get_reward are tools; prefix a helper's name with _ to keep it one)"
            )
    if causes:
        raise ValueError(
            f"this run has {'; and '.join(causes)}; tools are shown to the model by its chat template, and "
            "this tokenizer has none: use a chat model (e.g. a Qwen2.5-Instruct)"
        )
