"""Concurrent requests batched into engine calls, behind a gate that pauses generation.

Requests join a queue; the first of a batch waits `window_s` for others to arrive, then every
waiting request goes to the engine at once, in as few `generate` calls as the engine allows. An
engine whose `generate` takes one SamplingParams per prompt (`capabilities.per_prompt_params`: the
native engine) gets one call per set of distribution fields (temperature, top_p, top_k,
min_p, repetition_penalty), so requests that differ only in n, max_tokens, seed or stops share a
call; other engines get one call per distinct SamplingParams. Engine calls run one at a time in the
engine's own worker thread (pools.py), so the event loop keeps answering, under `lock`, which
weight writes take too.

The gate: while generation is paused (/pause) or held (a weight update, sleep), no batch starts
and new requests wait in the queue. Closing the gate waits for the running batch, so a weight
update always lands between two batches, never inside one.

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

    def withdraw_on_cancel(self) -> None:
        self.future.add_done_callback(lambda future: setattr(self, "withdrawn", future.cancelled()))


class Batcher:
    """Runs queued requests on `engine` in batches; pause, resume and exclusive holds."""

    def __init__(
        self, engine: RolloutEngine, *, window_s: float = 0.005, executor: Executor | None = None
    ) -> None:
        """`executor`: the thread engine calls run in (default: one of the batcher's own)."""
        self.engine, self.window_s = engine, window_s
        self.executor = executor or DaemonPool(1, "grpoflow-engine")
        self.lock = threading.Lock()
        self.per_prompt = engine.capabilities.per_prompt_params
        self.abortable = engine.capabilities.aborts
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

    async def _loop(self) -> None:
        while True:
            await self._arrived.wait()
            if self.window_s > 0:
                await asyncio.sleep(self.window_s)
            async with self._gate:
                await self._gate.wait_for(lambda: self.is_open)
                jobs = [job for job in self._queue if not job.future.done()]
                self._queue.clear()
                self._arrived.clear()
                self._running = bool(jobs)
            if not jobs:
                continue
            try:
                outcomes = await run_in(self.executor, self._run, jobs)
            except Exception as error:  # a bug here must not stop the loop: fail this batch only
                outcomes = [_as_request_error(error)] * len(jobs)
            finally:
                async with self._gate:
                    self._running = False
                    self._gate.notify_all()
            for job, outcome in zip(jobs, outcomes):
                _deliver(job, outcome)

    # -- the gate -----------------------------------------------------------------------------

    async def pause(self, mode: str = "wait") -> None:
        """Stop starting batches and wait for the running one. mode 'abort' also answers the
        queued requests at once with empty completions whose finish_reason is 'abort'; 'wait'
        and 'keep' leave them queued until /resume (a running batch always finishes: the
        in-process engine cannot cut a call short)."""
        async with self._gate:
            self.paused = True
            if mode == "abort":
                for job in self._queue:
                    _deliver(job, _aborted(job))
                self._queue.clear()
            await self._gate.wait_for(lambda: not self._running)

    async def resume(self) -> None:
        async with self._gate:
            self.paused = False
            self._gate.notify_all()

    async def hold(self) -> None:
        """Close the gate (holds nest) and wait until no batch runs."""
        async with self._gate:
            self._holds += 1
            try:
                await self._gate.wait_for(lambda: not self._running)
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

    def _run(self, jobs: list[Job]) -> list[Groups | RequestError]:
        with self.lock:
            self.num_batches += 1
            groups: dict[tuple, list[int]] = {}
            for index, job in enumerate(jobs):
                groups.setdefault(self._key(job.params), []).append(index)
            outcomes: list[Groups | RequestError] = [RequestError("not run", 500)] * len(jobs)
            for members in groups.values():
                for index, outcome in zip(members, self._run_group([jobs[i] for i in members])):
                    outcomes[index] = outcome
            return outcomes

    def _key(self, params: SamplingParams) -> tuple:
        names = DISTRIBUTION_FIELDS if self.per_prompt else [item.name for item in dataclasses.fields(params)]
        values = (getattr(params, name) for name in names)
        return tuple(tuple(value) if isinstance(value, list | tuple) else value for value in values)

    def _run_group(self, jobs: list[Job]) -> list[Groups | RequestError]:
        try:
            return self._generate(jobs)
        except Exception as error:
            if len(jobs) > 1:  # find the request that failed; the others are served alone
                return [outcome for job in jobs for outcome in self._run_group([job])]
            return [_as_request_error(error)]

    def _generate(self, jobs: list[Job]) -> list[Groups | RequestError]:
        prompts = [prompt for job in jobs for prompt in job.prompts]
        self.num_engine_calls += 1
        if self.per_prompt:
            params = [job.params for job in jobs for _ in job.prompts]
            extra = {"abandoned": _abandoned_prompts(jobs)} if self.abortable else {}
            groups = self.engine.generate(prompts, params, on_error="error_completion", **extra)
        else:
            groups = self.engine.generate(prompts, jobs[0].params)
        outcomes: list[Groups | RequestError] = []
        start = 0
        for job in jobs:
            mine = groups[start : start + len(job.prompts)]
            start += len(job.prompts)
            errors = [group[0].text for group in mine if group and group[0].finish_reason == "error"]
            outcomes.append(RequestError("; ".join(map(str, errors))) if errors else mine)
        return outcomes


def _abandoned_prompts(jobs: list[Job]) -> Callable[[], list[int]]:
    """The engine's `abandoned` hook for one call of `jobs`: the indices of the prompts of
    withdrawn jobs."""
    spans, start = [], 0
    for job in jobs:
        spans.append((job, range(start, start + len(job.prompts))))
        start += len(job.prompts)
    return lambda: [index for job, span in spans if job.withdrawn for index in span]


def _deliver(job: Job, outcome: Groups | RequestError) -> None:
    if job.future.done():  # withdrawn: its client went away
        return
    if isinstance(outcome, BaseException):
        job.future.set_exception(outcome)
    else:
        job.future.set_result(outcome)


def _aborted(job: Job) -> Groups:
    return [[Completion([], [], "abort") for _ in range(job.params.n)] for _ in job.prompts]


def _as_request_error(error: Exception) -> RequestError:
    if isinstance(error, RequestError):
        return error
    if isinstance(error, ValueError):
        return RequestError(str(error), 400)
    logger.exception("generation failed", exc_info=error)
    return RequestError(f"generation failed: {type(error).__name__}: {error}", 500)
