"""Concurrent requests batched into engine calls, behind a gate that pauses generation.

Requests join a queue; the first of a batch waits `window_s` for others to arrive, then the queued
requests go to the engine. Engine calls run one at a time in the engine's own worker thread
(pools.py), so the event loop keeps answering, under `lock`, which weight writes take too.

An engine whose `generate` takes one SamplingParams per prompt (`capabilities.per_prompt_params`:
the native engine) runs calls that requests join while they run. A call starts with the queued
requests that share the first one's distribution fields (temperature, top_p, top_k, min_p,
repetition_penalty); between two of its steps its `intake` hands it, in order, the requests queued
since with the same fields. The engine gives free rows to the requests in turn and answers each as
soon as its own sequences have finished, so a short request waits for a free row, not for a long
one to end. A request whose distribution fields differ cannot join a running call: from it on,
the queue waits for the next call (the running one takes no more and drains), as it does once a
call has taken `call_sequences` sequences (a bound on one call's bookkeeping). When a call fails,
its unanswered requests run again, each in a call of its own, so that only the one that fails gets
the error. Other engines get one call per distinct SamplingParams of a batch.

The gate: while generation is paused (/pause) or held (a weight update, sleep), no call starts and
the intake hands nothing, so new requests wait in the queue and the running call drains. Closing
the gate waits for that call, so a weight update lands between two calls, never inside a request.

A request whose client went away is dropped from the queue. If a running call serves it on an
engine that takes an `abandoned` hook (`capabilities.aborts`: the native engine), the engine stops
its sequences at the next step and gives their cache blocks back, so the rest of the call does not
wait for work nobody reads; on other engines the call finishes and its share is discarded.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
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
    alone: bool = False
    """It was in an engine call that failed: it runs in a call of its own, so that the request
    that fails is found and the others are served."""

    @property
    def size(self) -> int:
        """Its sequences (prompts x n)."""
        return len(self.prompts) * self.params.n


@dataclasses.dataclass(slots=True)
class Call:
    """A running engine call that requests join (read and written in the engine's thread)."""

    key: tuple
    """The distribution fields its requests share."""
    loop: asyncio.AbstractEventLoop
    ready: list[Job]
    """Requests to hand at the next look: the ones it starts with."""
    taken: int = 0
    """Sequences handed so far."""
    closed: bool = False
    """It takes no more requests: one queued differs, or it took `call_sequences`."""
    stamp: int = -1
    """The batcher's stamp at the last look at the queue."""
    withdrawals: int = -1
    """The batcher's count of withdrawn requests at the last look for abandoned ones."""
    num_prompts: int = 0
    handed: list[Job] = dataclasses.field(default_factory=list)
    open: dict[int, tuple[Job, range]] = dataclasses.field(default_factory=dict)
    """The requests handed and not answered yet, with their prompts' indices in the call."""


class Batcher:
    """Runs queued requests on `engine` in batches; pause, resume and exclusive holds."""

    def __init__(
        self,
        engine: RolloutEngine,
        *,
        window_s: float = 0.005,
        executor: Executor | None = None,
        call_sequences: int | None = None,
    ) -> None:
        """`executor`: the thread engine calls run in (default: one of the batcher's own).
        `call_sequences`: the sequences after which a running call takes no more requests (None:
        no bound); the requests it starts with may be more."""
        self.engine, self.window_s = engine, window_s
        self.executor = executor or DaemonPool(1, "grpoflow-engine")
        self.lock = threading.Lock()
        self.per_prompt = engine.capabilities.per_prompt_params
        self.abortable = engine.capabilities.aborts
        self.call_sequences = call_sequences
        self.paused = False
        self.num_batches = self.num_engine_calls = self.num_joined = 0
        self._queue: list[Job] = []
        self._queue_lock = threading.Lock()  # the engine's thread takes joining requests from the queue
        self._stamp = 0  # moves when a request arrives or the gate opens: the intake looks again
        self._withdrawals = 0
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
        with self._queue_lock:
            queued, self._queue = self._queue, []
        for job in queued:
            _deliver(job, RequestError("the server is shutting down", 503))

    # -- requests -----------------------------------------------------------------------------

    def submit(self, prompts: list[list[int]], params: SamplingParams) -> asyncio.Future:
        """Queue a request; the future gets one list of `params.n` completions per prompt, or a
        RequestError. Cancel the future to withdraw the request."""
        job = Job(prompts, params, asyncio.get_running_loop().create_future())
        job.future.add_done_callback(functools.partial(self._on_done, job))
        with self._queue_lock:
            self._queue.append(job)
            self._stamp += 1
        self._arrived.set()
        return job.future

    def _on_done(self, job: Job, future: asyncio.Future) -> None:
        if future.cancelled():
            job.withdrawn = True
            self._withdrawals += 1

    @property
    def is_open(self) -> bool:
        return not self.paused and self._holds == 0

    @property
    def busy(self) -> bool:
        """A call is running or requests are queued."""
        return self._running or bool(self._queue)

    async def _loop(self) -> None:
        while True:
            await self._arrived.wait()
            if self.window_s > 0:
                await asyncio.sleep(self.window_s)
            async with self._gate:
                await self._gate.wait_for(lambda: self.is_open)
                jobs = self._take_batch()
                self._running = bool(jobs)
            if not jobs:
                continue
            try:
                await (self._serve_joined(jobs) if self.per_prompt else self._serve(jobs))
            finally:
                async with self._gate:
                    self._running = False
                    self._gate.notify_all()

    def _take_batch(self) -> list[Job]:
        """The queued requests the next batch starts with: on a per-prompt engine, those that
        share the first one's distribution fields; on others, all."""
        with self._queue_lock:
            queued = [job for job in self._queue if not job.future.done()]
            key = self._key(queued[0].params) if queued and self.per_prompt else None
            chosen = [key is None or self._key(job.params) == key for job in queued]
            if queued and queued[0].alone:
                chosen = [index == 0 for index in range(len(queued))]
            self._queue = [job for job, taken in zip(queued, chosen) if not taken]
            if not self._queue:
                self._arrived.clear()
        return [job for job, taken in zip(queued, chosen) if taken]

    async def _serve(self, jobs: list[Job]) -> None:
        outcomes: list[Groups | RequestError] = []
        try:
            outcomes = await run_in(self.executor, self._run, jobs)
        except Exception as error:  # a bug here must not stop the loop: fail this batch only
            outcomes = [_as_request_error(error)] * len(jobs)
        finally:
            for job, outcome in zip(jobs, outcomes):
                _deliver(job, outcome)
            for job in jobs[len(outcomes) :]:  # cancelled while running
                _deliver(job, RequestError("the server is shutting down", 503))

    async def _serve_joined(self, jobs: list[Job]) -> None:
        call = Call(self._key(jobs[0].params), asyncio.get_running_loop(), jobs, closed=jobs[0].alone)
        try:
            await run_in(self.executor, self._run_joined, call)
        except asyncio.CancelledError:
            for job in call.handed + call.ready:
                _deliver(job, RequestError("the server is shutting down", 503))
            raise
        except Exception as error:  # a bug here must not stop the loop: fail this call only
            unanswered = [job for job, _ in call.open.values()] + call.ready
            if len(call.handed + call.ready) == 1:
                for job in unanswered:
                    _deliver(job, _as_request_error(error))
                return
            for job in unanswered:  # find the request that failed: each runs alone, first in line
                job.alone = True
            with self._queue_lock:
                self._queue[:0] = unanswered
            self._arrived.set()

    # -- the gate -----------------------------------------------------------------------------

    async def pause(self, mode: str = "wait") -> None:
        """Stop starting requests and wait for the running call. mode 'abort' also answers the
        queued requests at once with empty completions whose finish_reason is 'abort'; 'wait' and
        'keep' leave them queued until /resume (a running call always finishes, taking no more
        requests: the in-process engine cannot cut a call short)."""
        async with self._gate:
            self.paused = True
            if mode == "abort":
                with self._queue_lock:
                    queued, self._queue = self._queue, []
                for job in queued:
                    _deliver(job, [[Completion([], [], "abort")] * job.params.n for _ in job.prompts])
            await self._gate.wait_for(lambda: not self._running)

    async def resume(self) -> None:
        async with self._gate:
            self.paused = False
            self._stamp += 1
            self._gate.notify_all()

    async def hold(self) -> None:
        """Close the gate (holds nest) and wait until no call runs."""
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
            self._stamp += 1
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

    # -- engine calls that requests join (worker thread) ----------------------------------------

    def _run_joined(self, call: Call) -> None:
        with self.lock:
            self.num_batches += 1
            self.num_engine_calls += 1
            call.taken = sum(job.size for job in call.ready)
            extra = {"abandoned": functools.partial(self._abandoned, call)} if self.abortable else {}
            self.engine.generate(
                [],
                call.ready[0].params,
                on_error="error_completion",
                intake=functools.partial(self._intake, call),
                **extra,
            )

    def _intake(self, call: Call) -> list[tuple[list[list[int]], list[SamplingParams], Callable]]:
        """The requests that join `call` now: those it starts with, then those queued since the
        last look (none while the gate is closed). Without new arrivals, two comparisons."""
        jobs, call.ready = call.ready, []
        if call.stamp != self._stamp and not call.closed:
            with self._queue_lock:
                call.stamp = self._stamp
                if self.is_open:
                    jobs += self._joining(call)
        arrivals = []
        for job in jobs:
            call.open[id(job)] = (job, range(call.num_prompts, call.num_prompts + len(job.prompts)))
            call.num_prompts += len(job.prompts)
            call.handed.append(job)
            arrivals.append(
                (job.prompts, [job.params] * len(job.prompts), functools.partial(self._answer, call, job))
            )
        return arrivals

    def _joining(self, call: Call) -> list[Job]:
        """Take the requests at the head of the queue that may join `call`, up to the first that
        differs in distribution or would take it past `call_sequences` (then it is closed)."""
        taken = []
        while self._queue and not call.closed:
            job = self._queue[0]
            full = self.call_sequences is not None and call.taken + job.size > self.call_sequences
            if not job.withdrawn and (job.alone or full or self._key(job.params) != call.key):
                call.closed = True
                break
            self._queue.pop(0)
            if not job.withdrawn:
                taken.append(job)
                call.taken += job.size
        self.num_joined += len(taken)
        return taken

    def _answer(self, call: Call, job: Job, groups: Groups) -> None:
        """The engine's sink for `job`: its completions, or its error, go to its future."""
        del call.open[id(job)]
        errors = [group[0].text for group in groups if group and group[0].finish_reason == "error"]
        outcome = RequestError("; ".join(map(str, errors))) if errors else groups
        with contextlib.suppress(RuntimeError):  # the event loop is closed: nobody waits
            call.loop.call_soon_threadsafe(_deliver, job, outcome)

    def _abandoned(self, call: Call) -> list[int]:
        """The engine's `abandoned` hook: the prompts of the call's withdrawn requests; without a
        new withdrawal, one comparison."""
        if call.withdrawals == self._withdrawals:
            return []
        call.withdrawals = self._withdrawals
        return [index for job, span in list(call.open.values()) if job.withdrawn for index in span]

    # -- engine calls of one batch (worker thread) ----------------------------------------------

    def _run(self, jobs: list[Job]) -> list[Groups | RequestError]:
        """One outcome per job: its completions or its error."""
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
        extra = {"abandoned": _abandoned_prompts(jobs)} if self.abortable else {}
        groups = self.engine.generate(prompts, jobs[0].params, **extra)
        starts = [0]
        for job in jobs:
            starts.append(starts[-1] + len(job.prompts))
        return [groups[start:end] for start, end in zip(starts, starts[1:])]


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


def _as_request_error(error: Exception) -> RequestError:
    if isinstance(error, RequestError):
        return error
    if isinstance(error, ValueError):
        return RequestError(str(error), 400)
    logger.exception("generation failed", exc_info=error)
    return RequestError(f"generation failed: {type(error).__name__}: {error}", 500)
