"""Agent programs played in worker processes (`agent_workers`), so that the programs, their
`openai` clients and the hosted server's per-request work (parsing, chat templates, tokenising,
episode recording) do not share the training process's interpreter lock with the engine.

Each worker is started once (a "spawn" process: a CUDA process is never forked) and builds the
hosted server's app around a relay to the engine (grpoflow.server.relay): every engine call goes
down a pipe to the training process, whose one batcher runs it with all the others, behind the
gate the rollout opens while the programs run. A rollout's episodes are dealt to the workers in
turn, each with the seed and sampling the training process gave it; a worker plays its share with
`agent_concurrency / agent_workers` in flight (grpoflow.rollout.program_play) and sends back each
episode's outcome with its recorded turns, which the training process groups as it does its own.

A worker that dies (killed, out of memory), or does not send its outcomes within agent_timeout for
each round of its episodes plus SLACK_S (a program that blocks its event loop: it is killed), ends
the episodes it had as errors naming it, and is started again for the next rollout; one that cannot
start stops the run with its error.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import multiprocessing
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any

from grpoflow.agents.config import AgentConfig
from grpoflow.engines import RolloutEngine
from grpoflow.rollout.program_play import EpisodePlayer, ProgramOutcome
from grpoflow.rollout.program_turns import Endpoint, Episode
from grpoflow.server.relay import EngineRelay, RelayedServer, relayed_server, serve_relayed

logger = logging.getLogger("grpoflow.agents")

START_TIMEOUT_S = 300.0
"""Seconds a worker may take to start (import, build its app) before the run stops."""
STOP_TIMEOUT_S = 10.0
"""Seconds a worker may take to stop before it is killed."""
SLACK_S = 60.0
"""Seconds a worker may take past agent_timeout for each round of its episodes before it is
killed (a program that blocks its event loop, which no timeout inside the worker can end)."""


@dataclass(frozen=True, kw_only=True)
class WorkerSetup:
    """What a worker is started with (pickled to it)."""

    config: AgentConfig
    """The agent section, with this worker's share of agent_concurrency."""
    server: RelayedServer


class Worker:
    """One worker process and its two pipes: episodes and outcomes, and engine calls."""

    def __init__(self, index: int, setup: WorkerSetup, relay: EngineRelay) -> None:
        context = multiprocessing.get_context("spawn")
        self.index = index
        self.work, work_end = context.Pipe()
        self.engine_calls, calls_end = context.Pipe()
        self.process = context.Process(
            target=worker_main,
            args=(setup, work_end, calls_end),
            name=f"grpoflow-agent-worker-{index}",
            daemon=True,
        )
        self.deadline = 0.0
        """When the episodes it plays must be back (ProgramWorkers._allowed_s)."""
        self.overdue = False
        """It was killed for missing its deadline."""
        self.process.start()
        work_end.close()
        calls_end.close()
        relay.serve(self.engine_calls, f"worker-{index}")

    def wait_ready(self, timeout: float) -> None:
        """Return once the worker has built its app; RuntimeError with its cause otherwise."""
        if not wait([self.work, self.process.sentinel], timeout):
            raise RuntimeError(f"{self.name} did not start within {timeout:g} s")
        try:
            message = self.work.recv()
        except (EOFError, OSError):
            raise RuntimeError(
                f"{self.name} {self.exit_status()} while starting (see the log above)"
            ) from None
        if message[0] != "ready":
            raise RuntimeError(f"{self.name} could not start:\n{message[1]}")

    @property
    def name(self) -> str:
        return f"agent worker {self.index} (pid {self.process.pid})"

    def exit_status(self) -> str:
        self.process.join(timeout=1.0)
        code = self.process.exitcode
        if self.overdue:
            return "did not answer within agent_timeout for each round of its episodes and was killed"
        if code is None:
            return "stopped answering"
        return f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"

    def stop(self) -> None:
        with contextlib.suppress(OSError, ValueError):  # it died: nothing to tell
            self.work.send(("stop",))
        self.process.join(timeout=STOP_TIMEOUT_S)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(timeout=STOP_TIMEOUT_S)
        self.work.close()
        self.engine_calls.close()


class ProgramWorkers:
    """`count` worker processes playing a rollout's episodes against `engine`, which stays here
    behind its relay's gate (`open()` / `close()`, as a hosted server's)."""

    def __init__(
        self,
        engine: RolloutEngine,
        tokenizer,
        config: AgentConfig,
        count: int,
        *,
        model_name: str,
        max_model_len: int,
        **options: Any,
    ) -> None:
        server, device = relayed_server(
            engine, tokenizer, model_name=model_name, max_model_len=max_model_len, **options
        )
        self.relay = EngineRelay(engine, server.config, device)
        self.setups = [
            WorkerSetup(
                config=dataclasses.replace(
                    config,
                    agent_workers=0,
                    agent_concurrency=max(
                        1, config.agent_concurrency // count + (i < config.agent_concurrency % count)
                    ),
                ),
                server=server,
            )
            for i in range(count)
        ]
        self.workers: list[Worker | None] = [None] * count
        self.slack_s = SLACK_S
        try:
            self._start_missing()
        except BaseException:
            self.stop()
            raise
        logger.info("agent programs run in %d worker processes", count)

    def open(self) -> None:
        self.relay.open()

    def close(self) -> None:
        self.relay.close()

    def play(self, episodes: list[Episode]) -> list[ProgramOutcome]:
        """Each episode's outcome, in order: dealt to the workers in turn and played there."""
        self._start_missing()
        outcomes: list[ProgramOutcome | None] = [None] * len(episodes)
        shares: dict[Worker, list[int]] = {}
        for worker in self.workers:
            share = list(range(worker.index, len(episodes), len(self.workers)))
            if share:
                shares[worker] = share
                worker.deadline = time.monotonic() + self._allowed_s(worker, len(share))
                with contextlib.suppress(OSError, ValueError):  # it died: its sentinel tells below
                    worker.work.send(("play", [episodes[i] for i in share]))
        while shares:
            timeout = max(0.0, min(w.deadline for w in shares) - time.monotonic())
            ready = set(wait([w.work for w in shares] + [w.process.sentinel for w in shares], timeout))
            for worker in shares:
                if worker.deadline < time.monotonic() and not ready & {worker.work, worker.process.sentinel}:
                    worker.overdue = True
                    worker.process.kill()
            for worker in [w for w in shares if w.work in ready or w.process.sentinel in ready]:
                played = self._received(worker)
                if played is None and worker.process.sentinel not in ready:
                    continue
                share = shares.pop(worker)
                if played is None:
                    played = self._lost(worker, [episodes[i] for i in share])
                for index, outcome in zip(share, played):
                    outcomes[index] = outcome
        return outcomes

    def _allowed_s(self, worker: Worker, episodes: int) -> float:
        """How long `episodes` may take in `worker`: agent_timeout for each round of its
        agent_concurrency, one more for the turns' collection, and `slack_s`."""
        config = self.setups[worker.index].config
        rounds = -(-episodes // config.agent_concurrency) + 1
        return rounds * config.agent_timeout + self.slack_s

    def stop(self) -> None:
        for worker in self.workers:
            if worker is not None:
                worker.stop()
        self.workers = [None] * len(self.workers)
        self.relay.stop()

    def _start_missing(self) -> None:
        """Start the workers not running (all at first; one that died, for the next rollout)."""
        started = []
        for index, worker in enumerate(self.workers):
            if worker is None or not worker.process.is_alive():
                if worker is not None:
                    worker.stop()
                self.workers[index] = Worker(index, self.setups[index], self.relay)
                started.append(self.workers[index])
        for worker in started:
            worker.wait_ready(START_TIMEOUT_S)

    @staticmethod
    def _received(worker: Worker) -> list[ProgramOutcome] | None:
        """The outcomes the worker sent, or None when it sent none (it died)."""
        try:
            if not worker.work.poll():
                return None
            return worker.work.recv()[1]
        except (EOFError, OSError):
            return None

    @staticmethod
    def _lost(worker: Worker, episodes: list[Episode]) -> list[ProgramOutcome]:
        error = f"{worker.name} {worker.exit_status()} while playing it"
        logger.error(
            "%s: its %d episodes end as errors; it starts again for the next rollout", error, len(episodes)
        )
        return [
            ProgramOutcome(row={**e.item.columns, "prompt": e.item.prompt}, ending="error", error=error)
            for e in episodes
        ]


def worker_main(setup: WorkerSetup, work: Connection, engine_calls: Connection) -> None:
    """A worker's life: build the app and the player, then play what arrives until told to stop."""
    try:
        player = EpisodePlayer(setup.config)
        hosted = serve_relayed(setup.server, engine_calls)
        player.host(hosted)
    except Exception:
        work.send(("failed", traceback.format_exc()))
        return
    work.send(("ready",))
    endpoints = [Endpoint(hosted.url, hosted.api_key, hosted.model_name)]
    try:
        while True:
            try:
                message = work.recv()
            except (EOFError, OSError):
                break
            if message[0] == "stop":
                break
            work.send(("played", player.play(endpoints, message[1])))
    finally:
        hosted.stop()
        player.close()
