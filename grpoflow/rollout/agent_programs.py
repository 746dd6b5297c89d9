"""Episodes played by an agent program of the user's own, written against the `openai` client.

The contract (`agent_program: my_agent.py:agent`)::

    async def agent(client: openai.AsyncOpenAI, model: str, row: dict) -> float | None:
        messages = [{"role": "user", "content": row["question"]}]
        while True:
            reply = await client.chat.completions.create(model=model, messages=messages, tools=TOOLS)
            ...  # run the tool calls, append the answers, stop when done
        return reward

One call per episode (`num_generations` per prompt), `agent_concurrency` of them in flight on one
event loop, each bounded by `agent_timeout`. `row` is the dataset row (its `prompt` included).
`client` already points at the policy and names the episode in every request, so the program calls
`client.chat.completions.create` as against any OpenAI server; a plain `def agent(client, model,
row)` gets an `openai.OpenAI` and runs on one of `agent_concurrency` daemon threads: one that hangs
past `agent_timeout` keeps its thread until it returns, and the episodes after it wait for a free
one within their own timeout, so a hanging program never grows the run's thread count. What the program returns is the
episode's reward, `agent_program` (None: no reward from it), beside any `reward_funcs`, which get
the final answer (the last turn's message, or the conversation after the prompt for chat prompts).
The client's transport imposes the run's sampling (`grpoflow.agents.program_client`).

Where the policy is served: an engine in the training process (native, hf, vLLM colocate) is hosted
by `grpoflow serve`'s app on 127.0.0.1 (`grpoflow.server.hosted`), whose gate is open only while
the programs run, so they never meet the trainer's weight updates or sleep; with `vllm_mode:
server` the programs talk to the run's `grpoflow serve` servers themselves. Either way the server
records every turn; once the program returns, the episode's turns are fetched (and deleted) and
chained into training sequences (`grpoflow.chat.trajectory`): one per run of turns that extend each
other, every sampled token trained with the log-prob it was sampled with.

A program that raises, or runs past `agent_timeout`, or records no turn, ends only its own
episode: it trains with advantage 0 (no reward), and the error is logged with its row. A request
past the episode's `max_completion_length` is refused; the episode ends there and is trained as
truncated.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
import numbers
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from grpoflow import imports
from grpoflow.agents.config import AgentConfig
from grpoflow.chat.trajectory import Trajectory, chain_turns
from grpoflow.data.prompts import PromptItem
from grpoflow.engines import Completion, RolloutEngine, SamplingParams
from grpoflow.rollout.groups import Group
from grpoflow.rollout.program_turns import (
    Endpoint,
    common_prefix,
    new_episode_id,
    take_episode,
    training_completion,
)
from grpoflow.threads import DaemonPool

if TYPE_CHECKING:
    import httpx

    from grpoflow.agents.program_client import EpisodeBudget, SharedConnections
    from grpoflow.server.in_process import InProcessConnections

logger = logging.getLogger("grpoflow.agents")

PROGRAM_REWARD = "agent_program"
"""The reward column of what the program returns."""
ENDINGS = ("stop", "length", "budget", "timeout", "error")
"""How an episode ended: its program returned (within max_completion_length, or having used all of
it); a request past max_completion_length was refused; agent_timeout; an error or no recorded
turn."""


@dataclass(slots=True)
class ProgramOutcome:
    """How one episode went; reward functions receive it as the episode's `environments` entry."""

    row: dict[str, Any]
    reward: float | None = None
    error: str | None = None
    ending: str = "stop"
    turns: list[dict[str, Any]] = field(default_factory=list)
    """The recorded turns, as GET /v1/episodes/ID returns them (emptied once trained on)."""
    num_turns: int = 0
    """Turns recorded."""
    num_dropped: int = 0
    """Recorded turns left out of the training sequences (past max_completion_length)."""
    num_segments: int = 0
    """Sequences the episode trains as: its runs of turns that extend each other
    (grpoflow.chat.trajectory); 0 for an episode that failed."""


def program_rewards() -> list[tuple[str, Callable[..., Any]]]:
    """The reward function reading what each episode's program returned."""

    def agent_program(completions: list, environments: list, **kwargs: Any) -> list[float | None]:
        return [outcome.reward if isinstance(outcome, ProgramOutcome) else None for outcome in environments]

    return [(PROGRAM_REWARD, agent_program)]


def load_agent_program(spec: str) -> Callable[..., Any]:
    """The function `agent_program` names, checked to take (client, model, row)."""
    program = imports.load_object(spec, "Agent program")
    if not callable(program):
        raise ValueError(f"agent_program {spec!r} is a {type(program).__name__}, not a function")
    try:
        inspect.signature(program).bind(None, None, None)
    except TypeError:
        raise ValueError(
            f"agent_program {spec!r} must take three arguments, (client, model, row): an "
            "openai.AsyncOpenAI (an openai.OpenAI for a plain def), the served model's name and the "
            "dataset row"
        ) from None
    except ValueError:  # no signature to read (a builtin): take it as it is
        pass
    return program


def is_async(program: Callable[..., Any]) -> bool:
    """Whether calling `program` gives a coroutine (an async function, or an object whose
    `__call__` is one)."""
    call = type(program).__call__ if not inspect.isroutine(program) else None
    return inspect.iscoroutinefunction(program) or inspect.iscoroutinefunction(call)


class AgentPrograms:
    """A `Rollout` whose episodes an agent program plays (module docstring).

    Args:
        config: the agent section (agent_program, agent_concurrency, agent_timeout, max_turn_tokens).
        tokenizer: the policy's tokenizer (served with the hosted engine).
        model_name: the name the program passes as `model` to a hosted engine.
        max_model_len: the in-process engine's context.
        tool_call_parser: how the hosted server reads tool calls.
        server_api_key: the rollout servers' API key (vllm_mode server), if they have one.
    """

    def __init__(
        self,
        config: AgentConfig,
        tokenizer,
        *,
        model_name: str,
        max_model_len: int,
        tool_call_parser: str = "auto",
        server_api_key: str | None = None,
    ) -> None:
        self.config, self.tokenizer = config, tokenizer
        self.program = load_agent_program(config.agent_program)
        self.asynchronous = is_async(self.program)
        self.model_name, self.max_model_len = model_name, max_model_len
        self.tool_call_parser = tool_call_parser
        self.server_api_key = server_api_key or "EMPTY"
        self.last_metrics: dict[str, float] = {}
        self.hosted = None
        self._hosted_engine: RolloutEngine | None = None
        self._checked_urls: set[str] = set()
        self._warned_dropped = False
        # One loop for the rollout's life; asyncio.run would wait at its end for threads that overran.
        self._loop = asyncio.new_event_loop()
        self.workers = DaemonPool(config.agent_concurrency, "grpoflow-agent")
        """Where a plain (synchronous) program runs (one that hangs holds its thread)."""
        self.connections: SharedConnections | InProcessConnections | None = None
        """What every episode's client sends through (made on first use): the hosted server's app
        called in-process, or connection pools to the rollout servers."""

    def __call__(
        self, engine: RolloutEngine, items: Sequence[PromptItem], params: SamplingParams | list
    ) -> list[Group]:
        per_item = params if isinstance(params, list) else [params] * len(items)
        endpoints = self._endpoints(engine)
        started = time.perf_counter()
        if self.hosted is not None:
            self.hosted.open()
        try:
            played = self._loop.run_until_complete(self._play_all(endpoints, items, per_item))
        finally:
            if self.hosted is not None:
                self.hosted.close()
        seconds = time.perf_counter() - started
        max_length = per_item[0].max_tokens if per_item else 1
        groups = [self._group(item, outcomes, max_length, engine.policy_version) for item, outcomes in played]
        self.last_metrics = self._metrics([o for _, outcomes in played for o in outcomes], groups, seconds)
        return groups

    def close(self) -> None:
        if self.hosted is not None:
            self.hosted.stop()
            self.hosted = None
        self.workers.shutdown()
        if self.connections is not None:
            self._loop.run_until_complete(self.connections.aclose())
        self._loop.close()

    # -- where the policy is served -------------------------------------------------------------

    def _endpoints(self, engine: RolloutEngine) -> list[Endpoint]:
        servers = engine.capabilities.servers
        if servers:  # rollout servers: the programs sample from them directly
            for url, _ in servers:
                self._check_records_episodes(url)
            return [Endpoint(url, self.server_api_key, name) for url, name in servers]
        if self._hosted_engine is not engine:
            from grpoflow.server.hosted import host_engine

            if self.hosted is not None:
                self.hosted.stop()
            self.connections = None
            self.hosted = host_engine(
                engine,
                self.tokenizer,
                model_name=self.model_name,
                max_model_len=self.max_model_len,
                tool_call_parser=self.tool_call_parser,
                max_recorded_episodes=max(1024, 2 * self.config.agent_concurrency),
            )
            self._hosted_engine = engine
        return [Endpoint(self.hosted.url, self.hosted.api_key, self.model_name)]

    def _check_records_episodes(self, url: str) -> None:
        if url in self._checked_urls:
            return
        import httpx

        headers = {"Authorization": f"Bearer {self.server_api_key}"}
        answer = httpx.get(f"{url}/v1/episodes", headers=headers, timeout=30)
        if answer.status_code != 200:
            raise ValueError(
                f"agent_program needs rollout servers that record agent episodes, and {url} answered "
                f"GET /v1/episodes with {answer.status_code}: serve the policy with `grpoflow serve`"
            )
        self._checked_urls.add(url)

    # -- playing ----------------------------------------------------------------------------------

    async def _play_all(
        self, endpoints: list[Endpoint], items: Sequence[PromptItem], per_item: list[SamplingParams]
    ) -> list[tuple[PromptItem, list[ProgramOutcome]]]:
        import httpx

        gate = asyncio.Semaphore(self.config.agent_concurrency)
        async with httpx.AsyncClient(timeout=60) as fetcher:
            plays = []
            for item, params in zip(items, per_item, strict=True):
                for index in range(params.n):
                    endpoint = endpoints[len(plays) % len(endpoints)]
                    seed = None if params.seed is None else (params.seed * 1_000_003 + index * 7_919) % 2**62
                    plays.append(self._play(gate, fetcher, endpoint, item, params, seed))
            outcomes = list(await asyncio.gather(*plays))
        played, start = [], 0
        for item, params in zip(items, per_item):
            played.append((item, outcomes[start : start + params.n]))
            start += params.n
        return played

    async def _play(
        self,
        gate: asyncio.Semaphore,
        fetcher: httpx.AsyncClient,
        endpoint: Endpoint,
        item: PromptItem,
        params: SamplingParams,
        seed: int | None,
    ) -> ProgramOutcome:
        from grpoflow.agents.program_client import EpisodeBudget, RunSampling

        sampling = RunSampling(
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k,
            min_p=params.min_p,
            repetition_penalty=params.repetition_penalty,
            max_completion_length=params.max_tokens,
            max_turn_tokens=self.config.max_turn_tokens,
        )
        async with gate:
            episode_id = new_episode_id()
            budget = EpisodeBudget(sampling, seed=seed)
            outcome = ProgramOutcome(row={**item.columns, "prompt": item.prompt})
            try:
                outcome.reward = reward_value(
                    await self._run(endpoint, episode_id, budget, dict(outcome.row))
                )
            except TimeoutError:
                outcome.ending = "timeout"
                outcome.error = f"the program ran past agent_timeout={self.config.agent_timeout:g} s"
            except Exception as error:
                if not budget.exhausted:
                    outcome.ending, outcome.error = "error", f"{type(error).__name__}: {error}"
            finally:
                budget.closed = True
            if budget.exhausted and outcome.error is None:
                outcome.ending = "budget"
            try:
                hosted = self.hosted
                taken = (
                    take_episode(fetcher, endpoint, episode_id)
                    if hosted is None
                    else hosted.take_episode(episode_id)
                )
                outcome.turns = await taken
            except Exception as error:
                outcome.ending, outcome.error = "error", f"its turns could not be fetched: {error}"
            if not outcome.turns and outcome.error is None:
                outcome.ending, outcome.error = "error", "the program made no chat completion request"
            if outcome.error is not None:
                outcome.reward = None  # a failed episode trains with advantage 0
            return outcome

    async def _run(
        self, endpoint: Endpoint, episode_id: str, budget: EpisodeBudget, row: dict[str, Any]
    ) -> Any:
        from grpoflow.agents.program_client import SharedConnections, episode_client

        if self.connections is None:
            hosted = self.hosted
            self.connections = (
                hosted.connections()
                if hosted is not None
                else SharedConnections(self.config.agent_concurrency)
            )
        timeout = self.config.agent_timeout
        client = episode_client(
            f"{endpoint.url}/v1",
            endpoint.api_key,
            episode_id,
            budget,
            self.connections,
            asynchronous=self.asynchronous,
            timeout=timeout,
        )
        try:
            if self.asynchronous:
                return await asyncio.wait_for(self.program(client, endpoint.model, row), timeout)
            running = asyncio.wrap_future(self.workers.submit(self.program, client, endpoint.model, row))
            return await asyncio.wait_for(running, timeout)
        finally:
            if self.asynchronous:
                await client.close()
            else:
                client.close()

    # -- groups -------------------------------------------------------------------------------

    def _group(
        self, item: PromptItem, outcomes: list[ProgramOutcome], max_length: int, version: int
    ) -> Group:
        trajectories: list[Trajectory | None] = [
            chain_turns(o.turns, max_length) if o.error is None else None for o in outcomes
        ]
        kept = [t for t in trajectories if t is not None]
        for index, trajectory in enumerate(trajectories):  # a group trains from one shared prompt
            if trajectory is not None and trajectory.prompt_ids[:1] != kept[0].prompt_ids[:1]:
                trajectories[index] = None
                outcomes[index].ending, outcomes[index].reward = "error", None
                outcomes[index].error = "its first prompt shares no token with its group's first episode's"
        shared = common_prefix([t.prompt_ids for t in trajectories if t is not None])
        completions, starts, texts, conversations = [], [], [], []
        for outcome, trajectory in zip(outcomes, trajectories):
            if trajectory is None:
                completions.append(Completion([], [], "error", version, text=outcome.error, mask=[]))
                starts.append([])
                texts.append("")
                conversations.append([])
                continue
            if outcome.ending == "budget":  # ended by the run's limits, not by the program
                trajectory = replace(trajectory, truncated=True)
            completion, sequence_starts = training_completion(trajectory, len(shared))
            completions.append(completion)
            starts.append(sequence_starts)
            first, last = outcome.turns[0], outcome.turns[-1]
            texts.append(last["message"].get("content") or "")
            conversations.append([*last["messages"][len(first["messages"]) :], last["message"]])
            outcome.num_dropped, outcome.num_segments = trajectory.num_dropped, trajectory.num_segments
            if trajectory.truncated and outcome.ending == "stop":
                outcome.ending = "length"
        for outcome in outcomes:
            outcome.num_turns, outcome.turns = len(outcome.turns), []
        return Group(
            item=replace(item, prompt_ids=shared or list(item.prompt_ids)),
            completions=completions,
            texts=texts,
            conversations=conversations,
            environments=list(outcomes),
            sequence_starts=starts if any(starts) else None,
        )

    def _metrics(
        self, outcomes: list[ProgramOutcome], groups: list[Group], seconds: float
    ) -> dict[str, float]:
        count = max(1, len(outcomes))
        completions = [c for group in groups for c in group.completions]
        tokens = sum(len(c.token_ids) for c in completions)
        inserted = sum(len(c.token_ids) - sum(c.loss_mask) for c in completions)
        dropped = sum(o.num_dropped for o in outcomes)
        self._log_failures(outcomes, dropped)
        endings = Counter(o.ending for o in outcomes)
        metrics = {
            "episodes/turns_mean": sum(o.num_turns for o in outcomes) / count,
            "episodes/dropped_turns_mean": dropped / count,
            "episodes/segments_mean": sum(o.num_segments for o in outcomes) / count,
            "episodes/masked_token_fraction": inserted / tokens if tokens else 0.0,
            "episodes/errors": sum(o.error is not None for o in outcomes) / count,
            "time/agent": seconds,
        }
        for ending in ENDINGS:
            metrics[f"episodes/ended_by/{ending}"] = endings.get(ending, 0) / count
        return metrics

    def _log_failures(self, outcomes: list[ProgramOutcome], dropped: int) -> None:
        """One warning per distinct error of the rollout, with its count and the first row it
        came with; the dropped turns once per run."""
        rows: dict[str, dict] = {}
        counts = Counter(o.error for o in outcomes if o.error is not None)
        for outcome in outcomes:
            if outcome.error is not None:
                rows.setdefault(outcome.error, outcome.row)
        for error, count in counts.items():
            logger.warning(
                "%d agent program episode%s failed and get no reward: %s; first row %s",
                count,
                "" if count == 1 else "s",
                error,
                short(rows[error]),
            )
        if dropped and not self._warned_dropped:
            self._warned_dropped = True
            logger.warning(
                "%d recorded turns were dropped: each began past max_completion_length tokens after "
                "its run's prompt (episodes/dropped_turns_mean); raise max_completion_length to train "
                "them; warned once",
                dropped,
            )


def reward_value(value: Any) -> float | None:
    """What a program returned as a reward: a number, or None for none."""
    if value is None:
        return None
    if isinstance(value, numbers.Real):
        value = float(value)
        return None if math.isnan(value) else value
    raise TypeError(
        f"the program returned {type(value).__name__} {str(value)[:80]!r}: return a number or None"
    )


def short(row: dict[str, Any], limit: int = 200) -> str:
    text = repr(row)
    return text if len(text) <= limit else text[: limit - 3] + "..."
