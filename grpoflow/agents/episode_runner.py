"""Episodes of several turns for a batch of prompts.

Every active episode's next turn goes into one engine call, so the engine batches them all; then
every episode's environment work (tool calls, `respond`) runs concurrently, each call bounded by
`environment_timeout`. A turn lasts as long as its slowest environment call, at most that timeout.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from grpoflow.agents.config import AgentConfig
from grpoflow.agents.episodes import FINISH_REASONS, Episode
from grpoflow.agents.grouped_warnings import GroupedWarnings
from grpoflow.agents.render import TurnRenderer
from grpoflow.agents.tools import ToolBox, environment_tools, tool_schema
from grpoflow.algo.draws import request_keys
from grpoflow.chat.tool_calls import parse_tool_calls, resolve_tool_call_format
from grpoflow.data.prompts import PromptItem, encode_prompt
from grpoflow.engines import PrefillStats, RolloutEngine, SamplingParams, prefix_cache_metrics
from grpoflow.threads import DaemonPool

logger = logging.getLogger("grpoflow.agents")

EnvironmentFactories = Mapping[str | None, Callable[[], Any]]
"""Environment classes by the name a row's `environment` column gives; the one key None when
`environment_factory` names a single class (every row uses it)."""


def environment_factories(factory: Callable[[], Any] | Mapping | None) -> EnvironmentFactories | None:
    """A single factory or a mapping of them, as a mapping (TRL's rule: a single one is keyed None)."""
    if factory is None:
        return None
    return dict(factory) if isinstance(factory, Mapping) else {None: factory}


class EpisodeRunner:
    """Runs the episodes of a batch (see the module docstring).

    Args:
        config: the agent section.
        tokenizer: the policy's tokenizer.
        tools: the plain tool functions (resolved from `config.tools`).
        environment_factory: builds one environment per episode; or a mapping of names to such
            factories, from which each row's `environment` column picks; None for tools alone.
        max_completion_length: token budget of an episode after its prompt.
        max_prompt_length: most tokens of a prompt once tools and `reset`'s text are in it.
        system: the system prompt of the data section.
        per_prompt_params: the engine takes one SamplingParams per prompt.
    """

    def __init__(
        self,
        config: AgentConfig,
        tokenizer,
        *,
        tools: Sequence[Callable[..., Any]] = (),
        environment_factory: Callable[[], Any] | Mapping[str, Callable[[], Any]] | None = None,
        max_completion_length: int,
        max_prompt_length: int | None = None,
        system: str | None = None,
        per_prompt_params: bool = False,
    ) -> None:
        self.config, self.tokenizer = config, tokenizer
        self.tools = list(tools)
        self.environment_factories = environment_factories(environment_factory)
        self.max_completion_length, self.system = max_completion_length, system
        self.max_prompt_length = max_prompt_length
        self.per_prompt_params = per_prompt_params
        self.tool_call_format = resolve_tool_call_format(config.tool_call_parser, tokenizer)
        self.last_metrics: dict[str, float] = {}
        self.warnings = GroupedWarnings(logger)
        """The rollout's per-episode warnings, logged once each with a count when it ends."""
        # One loop for the runner's life; asyncio.run would wait at its end for threads that overran.
        self._loop = asyncio.new_event_loop()
        self.workers = DaemonPool(config.environment_workers, "grpoflow-environment")
        """Where synchronous tools and environment hooks run (a hung one holds its thread)."""

    def run(
        self, engine: RolloutEngine, items: Sequence[PromptItem], params: SamplingParams | list
    ) -> list[list[Episode]]:
        """`params.n` episodes for each item, played to their end; grouped by item."""
        started = time.perf_counter()
        per_item = params if isinstance(params, list) else [params] * len(items)
        groups = self._loop.run_until_complete(self._start_all(items, per_item[0].n))
        episodes = [episode for group in groups for episode in group]
        seeds = {id(episode): p.seed for group, p in zip(groups, per_item) for episode in group}
        environment_seconds = 0.0
        prefill: PrefillStats | None = None  # summed over turns, when the engine counts it
        while active := [episode for episode in episodes if episode.finish is None]:
            self._generate_turn(engine, active, per_item[0], seeds)
            turn = engine.stats.prefill
            if turn is not None:
                prefill = turn if prefill is None else prefill + turn
            before = time.perf_counter()
            self._loop.run_until_complete(
                self._answer_all([episode for episode in active if episode.finish is None])
            )
            environment_seconds += time.perf_counter() - before
        self.warnings.flush()
        self.last_metrics = self._metrics(episodes, environment_seconds, time.perf_counter() - started)
        self.last_metrics.update(prefix_cache_metrics(prefill))
        return groups

    async def _start_all(self, items: Sequence[PromptItem], n: int) -> list[list[Episode]]:
        starts = [self._start(item, index) for item in items for index in range(n)]
        episodes = list(await asyncio.gather(*starts))
        return [episodes[index * n : (index + 1) * n] for index in range(len(items))]

    async def _start(self, item: PromptItem, index: int) -> Episode:
        episode = Episode(item, item.prompt, item.prompt_ids, index=index)
        try:
            columns = item.columns
            if self.environment_factories is not None:
                factory, columns = self._select_environment(item.columns)
                episode.environment = factory()
            observation = await self._call(episode, "reset", **columns, prompt=item.prompt)
        except Exception as error:
            self.warnings.add(f"could not start: {_describe(error)}; skipped (no reward)")
            episode.end("error", _describe(error))
            return episode
        episode.tools = self._tools_of(episode)
        episode.tool_schemas = [tool_schema(tool) for tool in episode.tools]
        if observation is not None or episode.tool_schemas:
            episode.prompt = _with_observation(item.prompt, observation)
            episode.prompt_ids = encode_prompt(
                self.tokenizer, episode.prompt, self.system, tools=episode.tool_schemas or None
            )
        if self.max_prompt_length is not None and len(episode.prompt_ids) > self.max_prompt_length:
            message = (
                f"with its tools and reset text the prompt has {len(episode.prompt_ids)} tokens > "
                f"max_prompt_length={self.max_prompt_length}; raise max_prompt_length"
            )
            self.warnings.add(f"could not start: {message}; skipped (no reward)")
            episode.end("error", message)
        return episode

    def _select_environment(self, columns: dict[str, Any]) -> tuple[Callable[[], Any], dict[str, Any]]:
        """The factory a row's `environment` column names (TRL's rule; the column is not passed
        to `reset`), or the single one; the columns `reset` receives."""
        factories = self.environment_factories
        if list(factories) == [None]:
            return factories[None], columns
        name = columns.get("environment")
        if name not in factories:
            known = ", ".join(map(repr, factories))
            raise ValueError(
                f"the row's environment column is {name!r}, not one of the names in environment_factory "
                f"({known}); give the row one of them or add {name!r} to environment_factory"
            )
        return factories[name], {key: value for key, value in columns.items() if key != "environment"}

    def _generate_turn(
        self, engine: RolloutEngine, active: list[Episode], base: SamplingParams, seeds: dict
    ) -> None:
        budgets = [self._turn_budget(episode) for episode in active]
        params = [
            dataclasses.replace(base, n=1, max_tokens=budget, seed=_turn_seed(seeds[id(episode)], episode))
            for episode, budget in zip(active, budgets)
        ]
        if not self.per_prompt_params:  # one setting for all: the largest budget, cut per episode below
            params = dataclasses.replace(base, n=1, max_tokens=max(budgets))
        outputs = engine.generate([episode.engine_prompt for episode in active], params)
        seeded = isinstance(params, list) and all(request.seed is not None for request in params)
        for index, (episode, budget, (completion,)) in enumerate(zip(active, budgets, outputs, strict=True)):
            ids, logprobs = completion.token_ids[:budget], completion.logprobs[:budget]
            text = self.tokenizer.decode(ids, skip_special_tokens=True)
            keys = request_keys(params[index].seed, 0, len(ids)).tolist() if seeded else None
            episode.add_policy(ids, logprobs, text, completion.policy_version, keys)
            if len(episode.ids) >= self.max_completion_length:
                episode.end("length")
            elif self.config.max_turns is not None and episode.turns >= self.config.max_turns:
                episode.end("max_turns")

    def _turn_budget(self, episode: Episode) -> int:
        remaining = self.max_completion_length - len(episode.ids)
        per_turn = self.config.max_turn_tokens
        return max(1, min(remaining, per_turn) if per_turn is not None else remaining)

    async def _answer_all(self, episodes: list[Episode]) -> None:
        await asyncio.gather(*(self._answer(episode) for episode in episodes))

    async def _answer(self, episode: Episode) -> None:
        """The environment's answer to the episode's last turn, appended as ids (or its end)."""
        text = episode.messages[-1]["content"]
        try:
            messages = await self._tool_messages(episode, text)
            if messages is None:
                if not hasattr(episode.environment, "respond"):
                    episode.end("stop")
                    return
                reply = await self._call(episode, "respond", text)
                if reply is None:
                    episode.end("stop")
                    return
                messages = [{"role": "user", "content": str(reply)}]
        except Exception as error:
            self.warnings.add(f"the environment failed: {_describe(error)}; the episode ends (no reward)")
            episode.end("error", _describe(error))
            return
        if not messages:
            return  # the tool-call limit ended the episode
        ended_turn = bool(episode.ids) and episode.ids[-1] == self.tokenizer.eos_token_id
        renderer = TurnRenderer(self.tokenizer, episode.tool_schemas or None)
        suffix = renderer.suffix_ids(messages, ended_turn)
        if len(episode.ids) + len(suffix) >= self.max_completion_length:
            episode.end("budget")
            return
        episode.add_environment(suffix, messages)

    async def _tool_messages(self, episode: Episode, text: str) -> list[dict] | None:
        """Tool messages answering the turn's calls; None when it calls no tool; [] when the
        tool-call limit ends the episode instead."""
        tools = episode.tools
        if not tools:
            return None
        parsed = parse_tool_calls(text, self.tool_call_format, episode.tool_schemas)
        if not parsed.calls:
            return None
        limit = self.config.max_tool_calling_iterations
        if limit is not None and episode.tool_turns >= limit:
            episode.end("max_tool_calling_iterations")
            return []
        episode.tool_turns += 1
        box = ToolBox(tools, self.config.environment_timeout, self.workers)
        started = time.perf_counter()
        results = await asyncio.gather(*(box.call(call) for call in parsed.calls))
        episode.environment_seconds += time.perf_counter() - started
        episode.tool_calls += len(results)
        episode.tool_errors += sum(result.error for result in results)
        return [{"role": "tool", "name": result.name, "content": result.content} for result in results]

    def _tools_of(self, episode: Episode) -> list[Callable[..., Any]]:
        found = environment_tools(episode.environment) if episode.environment is not None else []
        return self.tools + found

    async def _call(self, episode: Episode, hook: str, *args: Any, **kwargs: Any) -> Any:
        """An environment hook, if it has it, bounded by environment_timeout."""
        method = getattr(episode.environment, hook, None)
        if method is None:
            return None
        started = time.perf_counter()
        try:
            if asyncio.iscoroutinefunction(method):
                return await asyncio.wait_for(method(*args, **kwargs), self.config.environment_timeout)
            running = asyncio.wrap_future(self.workers.submit(method, *args, **kwargs))
            return await asyncio.wait_for(running, self.config.environment_timeout)
        except TimeoutError:
            raise TimeoutError(
                f"{type(episode.environment).__name__}.{hook} took over environment_timeout="
                f"{self.config.environment_timeout:g} s"
            ) from None
        finally:
            episode.environment_seconds += time.perf_counter() - started

    def _metrics(
        self, episodes: list[Episode], environment_seconds: float, seconds: float
    ) -> dict[str, float]:
        count = max(1, len(episodes))
        tokens = sum(len(episode.mask) for episode in episodes)
        inserted = sum(len(episode.mask) - sum(episode.mask) for episode in episodes)
        finishes = Counter(episode.finish for episode in episodes)
        metrics = {
            "episodes/turns_mean": sum(episode.turns for episode in episodes) / count,
            "episodes/tool_calls_mean": sum(episode.tool_calls for episode in episodes) / count,
            "episodes/tool_errors_mean": sum(episode.tool_errors for episode in episodes) / count,
            "episodes/masked_token_fraction": inserted / tokens if tokens else 0.0,
            "time/environment": environment_seconds,
        }
        for reason in FINISH_REASONS:
            metrics[f"episodes/ended_by/{reason}"] = finishes.get(reason, 0) / count
        return metrics


def _with_observation(prompt: str | list[dict], observation: Any) -> str | list[dict]:
    """The prompt with `reset`'s text added to its last user message (TRL's rule)."""
    if observation is None:
        return prompt
    if isinstance(prompt, str):
        return prompt + str(observation)
    last = prompt[-1]
    return [*prompt[:-1], {**last, "content": f"{last['content']}{observation}"}]


def _turn_seed(seed: int | None, episode: Episode) -> int | None:
    """A seed per episode and turn from the prompt's seed, so episodes of a group differ."""
    if seed is None:
        return None
    return (seed * 1_000_003 + episode.index * 7_919 + episode.turns) % 2**62


def _describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"
