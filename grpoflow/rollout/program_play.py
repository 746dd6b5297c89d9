"""An agent program's episodes played: each a call of the program with its own `openai` client
(grpoflow.agents.program_client), `agent_concurrency` of them in flight on one event loop (a plain
`def` program on one of as many daemon threads), each bounded by `agent_timeout`; once it returns,
its recorded turns are taken from the server that recorded them. What the training process does
itself (agent_workers 0) and what each agent worker process does with its share of a rollout's
episodes (program_workers.py); grpoflow.rollout.agent_programs turns the outcomes into groups.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from grpoflow import imports
from grpoflow.agents.config import AgentConfig
from grpoflow.rollout.program_turns import Endpoint, Episode, new_episode_id, take_episode
from grpoflow.threads import DaemonPool

if TYPE_CHECKING:
    import httpx

    from grpoflow.agents.program_client import EpisodeBudget, SharedConnections
    from grpoflow.server.hosted import ServedApp
    from grpoflow.server.in_process import InProcessConnections


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


class EpisodePlayer:
    """Plays episodes of `config.agent_program` against the servers it is given (module docstring).

    `hosted`: the app serving the policy in this process, when it is hosted here (its recorder is
    read directly, its app called with no socket); None: the endpoints are rollout servers.
    """

    def __init__(self, config: AgentConfig) -> None:
        self.config = config
        self.program = load_agent_program(config.agent_program)
        self.asynchronous = is_async(self.program)
        self.hosted: ServedApp | None = None
        # One loop for the player's life; asyncio.run would wait at its end for threads that overran.
        self._loop = asyncio.new_event_loop()
        self.threads = DaemonPool(config.agent_concurrency, "grpoflow-agent")
        """Where a plain (synchronous) program runs (one that hangs holds its thread)."""
        self.connections: SharedConnections | InProcessConnections | None = None
        """What every episode's client sends through (made on first use): the hosted server's app
        called in-process, or connection pools to the rollout servers."""

    def host(self, hosted: ServedApp | None) -> None:
        """Play against `hosted` from now on (None: against rollout servers)."""
        self.hosted, self.connections = hosted, None

    def play(self, endpoints: list[Endpoint], episodes: list[Episode]) -> list[ProgramOutcome]:
        """Each episode's outcome, in order; the endpoints taken in turn."""
        return self._loop.run_until_complete(self._play_all(endpoints, episodes))

    def close(self) -> None:
        self.threads.shutdown()
        if self.connections is not None:
            self._loop.run_until_complete(self.connections.aclose())
        self._loop.close()

    async def _play_all(self, endpoints: list[Endpoint], episodes: list[Episode]) -> list[ProgramOutcome]:
        import httpx

        gate = asyncio.Semaphore(self.config.agent_concurrency)
        async with httpx.AsyncClient(timeout=60) as fetcher:
            plays = [
                self._play(gate, fetcher, endpoints[index % len(endpoints)], episode)
                for index, episode in enumerate(episodes)
            ]
            return list(await asyncio.gather(*plays))

    async def _play(
        self,
        gate: asyncio.Semaphore,
        fetcher: httpx.AsyncClient,
        endpoint: Endpoint,
        episode: Episode,
    ) -> ProgramOutcome:
        from grpoflow.agents.program_client import EpisodeBudget, RunSampling

        item, params = episode.item, episode.params

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
            budget = EpisodeBudget(sampling, seed=episode.seed)
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
            running = asyncio.wrap_future(self.threads.submit(self.program, client, endpoint.model, row))
            return await asyncio.wait_for(running, timeout)
        finally:
            if self.asynchronous:
                await client.close()
            else:
                client.close()


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
