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
one within their own timeout, so a hanging program never grows the run's thread count. What the
program returns is the episode's reward, `agent_program` (None: no reward from it), beside any
`reward_funcs`, which get the final answer (the last turn's message, or the conversation after the
prompt for chat prompts).
The client's transport imposes the run's sampling (`grpoflow.agents.program_client`).

Where the policy is served: an engine in the training process (native, hf, vLLM colocate) is hosted
by `grpoflow serve`'s app on 127.0.0.1 (`grpoflow.server.hosted`), whose gate is open only while
the programs run, so they never meet the trainer's weight updates or sleep; with `agent_workers`,
the programs and copies of that app run in worker processes, and only the engine and its batcher
stay in the training process (`grpoflow.rollout.program_workers`); with `vllm_mode:
server` the programs talk to the run's `grpoflow serve` servers themselves. Either way the server
records every turn; once the program returns, the episode's turns are fetched (and deleted) and
chained into training sequences (`grpoflow.chat.trajectory`): one per run of turns that extend each
other, every sampled token trained with the log-prob it was sampled with. Under on_policy_sampling
(the update's check; a redraw would come after the program acted on the turns) that log-prob is the
batch-invariant engine's score, which the update compares with its own bit for bit; a turn the
server records as drawn with sampling other than the run's (a request sent past the given client)
is marked as no draw of the policy, rather than rewritten or refused: the program has already acted
on it, and its episode is left out of the loss (`program_turns.unverifiable`), warned once.

A program that raises, or runs past `agent_timeout`, or records no turn, ends only its own
episode: it trains with advantage 0 (no reward), and the error is logged with its row. A request
past the episode's `max_completion_length` is refused; the episode ends there and is trained as
truncated.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from grpoflow.agents.config import AgentConfig
from grpoflow.chat.trajectory import Trajectory, chain_turns
from grpoflow.data.prompts import PromptItem
from grpoflow.engines import Completion, RolloutEngine, SamplingParams
from grpoflow.rollout.groups import Group
from grpoflow.rollout.program_play import EpisodePlayer, ProgramOutcome, load_agent_program
from grpoflow.rollout.program_turns import (
    Endpoint,
    Episode,
    common_prefix,
    episodes_of,
    training_completion,
    unverifiable,
)

if TYPE_CHECKING:
    from grpoflow.rollout.program_workers import ProgramWorkers
    from grpoflow.server.hosted import HostedServer

__all__ = ["PROGRAM_REWARD", "AgentPrograms", "ProgramOutcome", "load_agent_program", "program_rewards"]

logger = logging.getLogger("grpoflow.agents")

PROGRAM_REWARD = "agent_program"
"""The reward column of what the program returns."""
ENDINGS = ("stop", "length", "budget", "timeout", "error")
"""How an episode ended: its program returned (within max_completion_length, or having used all of
it); a request past max_completion_length was refused; agent_timeout; an error or no recorded
turn."""


def program_rewards() -> list[tuple[str, Callable[..., Any]]]:
    """The reward function reading what each episode's program returned."""

    def agent_program(completions: list, environments: list, **kwargs: Any) -> list[float | None]:
        return [outcome.reward if isinstance(outcome, ProgramOutcome) else None for outcome in environments]

    return [(PROGRAM_REWARD, agent_program)]


class AgentPrograms:
    """A `Rollout` whose episodes an agent program plays (module docstring).

    Args:
        config: the agent section (agent_program, agent_concurrency, agent_timeout, max_turn_tokens).
        tokenizer: the policy's tokenizer (served with the hosted engine).
        model_name: the name the program passes as `model` to a hosted engine.
        max_model_len: the in-process engine's context.
        tool_call_parser: how the hosted server reads tool calls.
        server_api_key: the rollout servers' API key (vllm_mode server), if they have one.
        exact: the update checks every sampled token bit for bit (`on_policy_check: update`):
            a turn drawn with sampling other than the run's is marked as no draw of the policy
            (`program_turns.unverifiable`).
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
        exact: bool = False,
    ) -> None:
        self.config, self.tokenizer = config, tokenizer
        self.player = EpisodePlayer(config)
        """Plays the episodes in this process (agent_workers 0, or rollout servers)."""
        self.model_name, self.max_model_len = model_name, max_model_len
        self.tool_call_parser = tool_call_parser
        self.server_api_key = server_api_key or "EMPTY"
        self.last_metrics: dict[str, float] = {}
        self.hosted: HostedServer | None = None
        self.worker_processes: ProgramWorkers | None = None
        """Play the episodes instead, beside the hosted engine's relay (agent_workers > 0)."""
        self._hosted_engine: RolloutEngine | None = None
        self._checked_urls: set[str] = set()
        self.exact = exact
        self._warned_dropped = False
        self._warned_foreign = False

    def __call__(
        self, engine: RolloutEngine, items: Sequence[PromptItem], params: SamplingParams | list
    ) -> list[Group]:
        per_item = params if isinstance(params, list) else [params] * len(items)
        episodes = episodes_of(list(items), per_item)
        endpoints = self._endpoints(engine)
        started = time.perf_counter()
        gate = self.worker_processes or self.hosted  # None: rollout servers
        if gate is not None:
            gate.open()
        try:
            if self.worker_processes is not None:
                outcomes = self.worker_processes.play(episodes)
            else:
                outcomes = self.player.play(endpoints, episodes)
        finally:
            if gate is not None:
                gate.close()
        seconds = time.perf_counter() - started
        foreign = self._mark_unverifiable(outcomes, episodes) if self.exact else None
        max_length = per_item[0].max_tokens if per_item else 1
        groups, start = [], 0
        for item, item_params in zip(items, per_item):
            played = outcomes[start : start + item_params.n]
            groups.append(self._group(item, played, max_length, engine.policy_version))
            start += item_params.n
        self.last_metrics = self._metrics(outcomes, groups, seconds)
        if foreign is not None:
            self.last_metrics["on_policy/foreign_turn_fraction"] = foreign
        return groups

    def close(self) -> None:
        self._stop_hosting()
        self.player.close()

    # -- where the policy is served -------------------------------------------------------------

    def _endpoints(self, engine: RolloutEngine) -> list[Endpoint]:
        servers = engine.capabilities.servers
        if servers:  # rollout servers: the programs sample from them directly
            for url, _ in servers:
                self._check_records_episodes(url)
            return [Endpoint(url, self.server_api_key, name) for url, name in servers]
        if self._hosted_engine is not engine:
            self._stop_hosting()
            self._host(engine)
            self._hosted_engine = engine
        if self.hosted is None:  # the workers' apps serve it
            return []
        return [Endpoint(self.hosted.url, self.hosted.api_key, self.model_name)]

    def _host(self, engine: RolloutEngine) -> None:
        """Serve `engine` to the programs: in this process, or to agent_workers processes."""
        from grpoflow.server.hosted import host_engine, on_cuda

        options = dict(
            model_name=self.model_name,
            max_model_len=self.max_model_len,
            tool_call_parser=self.tool_call_parser,
            max_recorded_episodes=max(1024, 2 * self.config.agent_concurrency),
        )
        count = self.config.resolve_agent_workers(on_cuda(engine))
        if count > 0:
            from grpoflow.rollout.program_workers import ProgramWorkers

            self.worker_processes = ProgramWorkers(engine, self.tokenizer, self.config, count, **options)
        else:
            self.hosted = host_engine(engine, self.tokenizer, **options)
            self.player.host(self.hosted)

    def _stop_hosting(self) -> None:
        if self.hosted is not None:
            self.hosted.stop()
            self.hosted = None
            self.player.host(None)
        if self.worker_processes is not None:
            self.worker_processes.stop()
            self.worker_processes = None
        self._hosted_engine = None

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

    # -- groups -------------------------------------------------------------------------------

    def _mark_unverifiable(self, outcomes: list[ProgramOutcome], episodes: list[Episode]) -> float:
        """Mark the turns drawn with sampling other than their episode's (`unverifiable`); the
        fraction of all turns they are, warned of once per run."""
        total, foreign = 0, []
        for outcome, episode in zip(outcomes, episodes, strict=True):
            outcome.turns, sampled = unverifiable(outcome.turns, episode.params)
            total, foreign = total + len(outcome.turns), foreign + sampled
        if foreign and not self._warned_foreign:
            self._warned_foreign = True
            logger.warning(
                "%d of %d agent program turns were sampled with %s, not the run's %s: they are not the "
                "policy's draws, so the update's check leaves their episodes out of the loss "
                "(on_policy/unverified_fraction); send every request through the client the program is "
                "given, which samples as the run does; warned once",
                len(foreign),
                total,
                foreign[0] or "no recorded sampling",
                episodes[0].params.distribution(),
            )
        return len(foreign) / total if total else 0.0

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


def short(row: dict[str, Any], limit: int = 200) -> str:
    text = repr(row)
    return text if len(text) <= limit else text[: limit - 3] + "..."
