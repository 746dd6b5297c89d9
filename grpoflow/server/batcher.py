"""Concurrent requests batched into engine calls, behind a gate that pauses generation.

Requests join a queue; the first of a batch waits `window_s` for others to arrive, then every
waiting request goes to the engine at once, in as few `generate` calls as the engine allows. An
engine whose `generate` takes one SamplingParams per prompt (`capabilities.per_prompt_params`: the
native engine) gets one call per set of distribution fields (temperature, top_p, top_k,
min_p, repetition_penalty), so requests that differ only in n, max_tokens, seed or stops share a
call; other engines get one call per distinct SamplingParams. Engine calls run one at a time in the
engine's own worker thread (pools.py), so the event loop keeps answering, under `lock`, which
weight writes take too.

Turns: on a per-prompt engine a request of more than `turn_sequences` sequences (prompts x n) is
served in turns of that many (its prompts' samples split with `sample_offset`, so a seeded request
draws what it would in one call). A request left unfinished goes back to the queue behind the
requests that arrived meanwhile, each batch takes one turn of every queued request, and a short
request waits for at most one turn of a long one rather than for all of it.

The gate: while generation is paused (/pause) or held (a weight update, sleep), no batch starts
and new requests wait in the queue; a request already started runs its remaining turns. Closing
the gate waits for them and for the running batch, so a weight update always lands between two
requests' batches, never inside one request.

A request whose client went away is dropped from the queue. If its batch is already running on
an engine that takes an `abandoned` hook (`capabilities.aborts`: the native engine), the engine stops its sequences at the
next step and gives their cache blocks back, so the rest of the batch, and the requests queued
behind it, do not wait for work nobody reads; on other engines the call finishes and the request's
share of the results is discarded.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import threading
from collections.abc import Callable
from concurrent.futures import Executor
from typing import Any

from grpoflow.engines.base import Completion, RolloutEngine, SamplingParams
from grpoflow.server.errors import RequestError
from grpoflow.server.pools import run_in
from grpoflow.threads import DaemonPool

logger = logging.getLogger("grpoflow.server")

DISTRIBUTION_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
"""SamplingParams fields that every prompt of one per-prompt engine call must share."""

Groups = list[list[Completion]]
"""One list of `n` completions per prompt."""


@dataclasses.dataclass(slots=True)
class Job:
    """One request's prompts (token ids), its sampling parameters, and where its result goes."""

    prompts: list[list[int]]
    params: SamplingParams
    future: asyncio.Future
    withdrawn: bool = False
    """Set (on the event loop) when the future is cancelled: read by the engine's thread between
    steps, a plain flag rather than the future, which is not thread-safe."""
    handed: int = 0
    """Sequences (prompt-major) handed to the engine so far."""
    groups: list[list[Completion]] = dataclasses.field(default_factory=list)
    """The completions received so far, one list per prompt."""

    def withdraw_on_cancel(self) -> None:
        self.future.add_done_callback(lambda future: setattr(self, "withdrawn", future.cancelled()))

    @property
    def started(self) -> bool:
        """Some of its sequences were handed to the engine and its client still waits."""
        return self.handed > 0 and not self.future.done()

    @property
    def complete(self) -> bool:
        return self.handed == len(self.prompts) * self.params.n

    def take(self, limit: int | None) -> list[Piece]:
        """The next turn: up to `limit` (None: all) of the sequences not handed out yet, as
        (prompt index, params with that prompt's share of n and its first sample's offset)."""
        n, position = self.params.n, self.handed
        end = len(self.prompts) * n if limit is None else min(len(self.prompts) * n, position + limit)
        pieces = []
        while position < end:
            prompt, sample = divmod(position, n)
            count = min(n - sample, end - position)
            offset = self.params.sample_offset + sample
            pieces.append((prompt, dataclasses.replace(self.params, n=count, sample_offset=offset)))
            position += count
        self.handed = end
        return pieces

    def record(self, pieces: list[Piece], groups: Groups) -> None:
        """Add a turn's completions (one group per piece)."""
        if not self.groups:
            self.groups = [[] for _ in self.prompts]
        for (prompt, _), group in zip(pieces, groups):
            self.groups[prompt].extend(group)


Piece = tuple[int, SamplingParams]
"""A prompt of a request (its index) and the samples of it that one turn draws."""


@dataclasses.dataclass(slots=True)
class Turn:
    """The pieces of one request that one batch serves."""

    job: Job
    pieces: list[Piece]


class Batcher:
    """Runs queued requests on `engine` in batches; pause, resume and exclusive holds."""

    def __init__(
        self,
        engine: RolloutEngine,
        *,
        window_s: float = 0.005,
        executor: Executor | None = None,
        turn_sequences: int | None = None,
    ) -> None:
        """`executor`: the thread engine calls run in (default: one of the batcher's own).
        `turn_sequences`: the most sequences of one request in one batch, on a per-prompt engine
        (None: a whole request)."""
        self.engine, self.window_s = engine, window_s
        self.executor = executor or DaemonPool(1, "grpoflow-engine")
        self.lock = threading.Lock()
        self.per_prompt = engine.capabilities.per_prompt_params
        self.abortable = engine.capabilities.aborts
        self.turn_sequences = turn_sequences if self.per_prompt else None
        self.paused = False
        self.num_batches = self.num_engine_calls = 0
        self._queue: list[Job] = []
        self._arrived = asyncio.Event()
        self._gate = asyncio.Condition()
        self._holds = 0
        self._running = False
        self._task: asyncio.Task | None = None

    # -- lifecycle ----------------------------------------------------------------------------

    def start(self) -> None:
        """Start the batching loop (inside the running event loop)."""
        self._task = asyncio.get_running_loop().create_task(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for job in self._queue:
            _deliver(job, RequestError("the server is shutting down", 503))
        self._queue.clear()

    # -- requests -----------------------------------------------------------------------------

    def submit(self, prompts: list[list[int]], params: SamplingParams) -> asyncio.Future:
        """Queue a request; the future gets one list of `params.n` completions per prompt, or a
        RequestError. Cancel the future to withdraw the request."""
        job = Job(prompts, params, asyncio.get_running_loop().create_future())
        job.withdraw_on_cancel()
        self._queue.append(job)
        self._arrived.set()
        return job.future

    @property
    def is_open(self) -> bool:
        return not self.paused and self._holds == 0

    @property
    def _busy(self) -> bool:
        """A batch runs, or a started request waits for its next turn."""
        return self._running or any(job.started for job in self._queue)

    async def _loop(self) -> None:
        while True:
            await self._arrived.wait()
            if self.window_s > 0:
                await asyncio.sleep(self.window_s)
            async with self._gate:
                self._gate.notify_all()  # a started request withdrawn since may be what a hold waits for
                await self._gate.wait_for(lambda: self.is_open or self._busy)
                queued = [job for job in self._queue if not job.future.done()]
                jobs = [job for job in queued if self.is_open or job.started]
                self._queue = [job for job in queued if not (self.is_open or job.started)]
                if not self._queue:
                    self._arrived.clear()
                turns = [Turn(job, job.take(self.turn_sequences)) for job in jobs]
                self._running = bool(turns)
            if not turns:
                continue
            outcomes: list[Groups | RequestError] = []
            try:
                outcomes = await run_in(self.executor, self._run, turns)
            except Exception as error:  # a bug here must not stop the loop: fail this batch only
                outcomes = [_as_request_error(error)] * len(turns)
            finally:
                async with self._gate:
                    self._running = False
                    self._settle(turns, outcomes)
                    self._gate.notify_all()

    def _settle(self, turns: list[Turn], outcomes: list[Groups | RequestError]) -> None:
        """Answer the requests whose last turn ran (or failed); queue the others again, behind
        the requests that arrived meanwhile."""
        for turn, outcome in zip(turns, outcomes):
            job = turn.job
            if isinstance(outcome, RequestError):
                _deliver(job, outcome)
                continue
            job.record(turn.pieces, outcome)
            if job.complete:
                _deliver(job, job.groups)
            elif not job.future.done():
                self._queue.append(job)
                self._arrived.set()
        for job in [turn.job for turn in turns[len(outcomes) :]]:  # cancelled while running
            _deliver(job, RequestError("the server is shutting down", 503))

    # -- the gate -----------------------------------------------------------------------------

    async def pause(self, mode: str = "wait") -> None:
        """Stop starting requests and wait for the running batch and the started requests. mode
        'abort' also answers the queued requests at once, with what their turns so far generated
        and empty completions whose finish_reason is 'abort' for the rest; 'wait' and 'keep' leave
        them queued until /resume (a running batch always finishes: the in-process engine cannot
        cut a call short)."""
        async with self._gate:
            self.paused = True
            if mode == "abort":
                for job in self._queue:
                    _deliver(job, _aborted(job))
                self._queue.clear()
            await self._gate.wait_for(lambda: not self._busy)

    async def resume(self) -> None:
        async with self._gate:
            self.paused = False
            self._gate.notify_all()

    async def hold(self) -> None:
        """Close the gate (holds nest) and wait until no batch runs and no request is part-served."""
        async with self._gate:
            self._holds += 1
            try:
                await self._gate.wait_for(lambda: not self._busy)
            except BaseException:
                self._holds -= 1
                self._gate.notify_all()
                raise

    async def release(self) -> None:
        async with self._gate:
            self._holds = max(0, self._holds - 1)
            self._gate.notify_all()

    async def exclusive(self, function: Callable[..., Any], *args: Any) -> Any:
        """Run `function(*args)` in a worker thread between batches, with the engine lock held."""
        await self.hold()
        try:
            return await run_in(self.executor, self._locked, function, *args)
        finally:
            await self.release()

    def _locked(self, function: Callable[..., Any], *args: Any) -> Any:
        with self.lock:
            return function(*args)

    # -- engine calls (worker thread) ---------------------------------------------------------

    def _run(self, turns: list[Turn]) -> list[Groups | RequestError]:
        """One group of completions per piece of each turn, or the turn's request's error."""
        with self.lock:
            self.num_batches += 1
            groups: dict[tuple, list[int]] = {}
            for index, turn in enumerate(turns):
                groups.setdefault(self._key(turn.job.params), []).append(index)
            outcomes: list[Groups | RequestError] = [RequestError("not run", 500)] * len(turns)
            for members in groups.values():
                for index, outcome in zip(members, self._run_group([turns[i] for i in members])):
                    outcomes[index] = outcome
            return outcomes

    def _key(self, params: SamplingParams) -> tuple:
        names = DISTRIBUTION_FIELDS if self.per_prompt else [item.name for item in dataclasses.fields(params)]
        values = (getattr(params, name) for name in names)
        return tuple(tuple(value) if isinstance(value, list | tuple) else value for value in values)

    def _run_group(self, turns: list[Turn]) -> list[Groups | RequestError]:
        try:
            return self._generate(turns)
        except Exception as error:
            if len(turns) > 1:  # find the request that failed; the others are served alone
                return [outcome for turn in turns for outcome in self._run_group([turn])]
            return [_as_request_error(error)]

    def _generate(self, turns: list[Turn]) -> list[Groups | RequestError]:
        prompts = [turn.job.prompts[index] for turn in turns for index, _ in turn.pieces]
        self.num_engine_calls += 1
        if self.per_prompt:
            params = [piece for turn in turns for _, piece in turn.pieces]
            extra = {"abandoned": _abandoned_prompts(turns)} if self.abortable else {}
            groups = self.engine.generate(prompts, params, on_error="error_completion", **extra)
        else:
            groups = self.engine.generate(prompts, turns[0].job.params)
        outcomes: list[Groups | RequestError] = []
        start = 0
        for turn in turns:
            mine = groups[start : start + len(turn.pieces)]
            start += len(turn.pieces)
            errors = [group[0].text for group in mine if group and group[0].finish_reason == "error"]
            outcomes.append(RequestError("; ".join(map(str, errors))) if errors else mine)
        return outcomes


def _abandoned_prompts(turns: list[Turn]) -> Callable[[], list[int]]:
    """The engine's `abandoned` hook for one call of `turns`: the indices of the prompts of
    withdrawn jobs."""
    spans, start = [], 0
    for turn in turns:
        spans.append((turn.job, range(start, start + len(turn.pieces))))
        start += len(turn.pieces)
    return lambda: [index for job, span in spans if job.withdrawn for index in span]


def _deliver(job: Job, outcome: Groups | RequestError) -> None:
    if job.future.done():  # withdrawn: its client went away
        return
    if isinstance(outcome, BaseException):
        job.future.set_exception(outcome)
    else:
        job.future.set_result(outcome)


def _aborted(job: Job) -> Groups:
    """What the job's turns generated so far, filled up with empty completions ('abort')."""
    done = job.groups or [[] for _ in job.prompts]
    return [group + [Completion([], [], "abort") for _ in range(job.params.n - len(group))] for group in done]


def _as_request_error(error: Exception) -> RequestError:
    if isinstance(error, RequestError):
        return error
    if isinstance(error, ValueError):
        return RequestError(str(error), 400)
    logger.exception("generation failed", exc_info=error)
    return RequestError(f"generation failed: {type(error).__name__}: {error}", 500)
