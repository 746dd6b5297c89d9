"""An engine's batcher reached from other processes: agent-program worker processes host
`grpoflow serve`'s app (request parsing, chat templates, tokenising, episode recording) while the
engine stays in the training process.

In a worker, `RelayedBatcher` is the app's batcher: `submit` sends the request's prompts (token
ids) and SamplingParams down a pipe and gives a future for its completions; cancelling the future
(the episode ran past its timeout, the request's caller went away) sends a cancel. In the training
process, `EngineRelay` reads each worker's pipe in a thread of its own and hands every request to
the engine's one `Batcher`, whose gate, joins of running calls and aborts apply to it as to any
request; the completions, or the error, go back down the pipe. A cancel withdraws the request
there (on the native engine its sequences stop at the next step), and so does a worker's pipe
closing (the worker ended) for all of that worker's requests. `EngineRelay.open()` and `close()`
are a hosted server's gate: closed, no call starts and the running one drains, so a weight update
never lands inside a request.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import itertools
import threading
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

import torch

from grpoflow.engines.base import EngineCapabilities, EngineStats, RolloutEngine, SamplingParams
from grpoflow.server.batcher import Batcher
from grpoflow.server.build import served_limits
from grpoflow.server.errors import RequestError
from grpoflow.server.hosted import ServedApp, engine_device, engine_executor, hosted_config, served_module
from grpoflow.server.protocol import Limits
from grpoflow.server.service import CALL_SEQUENCES_PER_ROW, Service
from grpoflow.server.settings import ServeConfig

WORKER_GONE = "the agent worker process sending it ended"


class EngineRelay:
    """The training process's end: the engine's batcher on an event loop of its own thread, its
    gate closed until `open()`, serving the requests workers send (module docstring)."""

    def __init__(self, engine: RolloutEngine, config: ServeConfig, device: torch.device) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="grpoflow-relay", daemon=True)
        self._thread.start()
        self._executor = engine_executor(device)
        self.batcher: Batcher = self._run(self._start(engine, config))
        self.is_open = False

    async def _start(self, engine: RolloutEngine, config: ServeConfig) -> Batcher:
        batcher = Batcher(
            engine,
            window_s=config.batch_window_ms / 1000,
            executor=self._executor,
            call_sequences=CALL_SEQUENCES_PER_ROW * config.max_num_seqs,
        )
        batcher.start()
        await batcher.hold()
        return batcher

    def serve(self, connection: Connection, name: str) -> threading.Thread:
        """Serve the requests arriving on `connection` (a worker's end of its pipe is the other)
        until it closes."""
        reader = threading.Thread(
            target=self._read, args=(connection,), name=f"grpoflow-relay-{name}", daemon=True
        )
        reader.start()
        return reader

    def open(self) -> None:
        """Let requests reach the engine."""
        if not self.is_open:
            self._run(self.batcher.release())
            self.is_open = True

    def close(self) -> None:
        """Start no new engine call; returns once the running one has finished."""
        if self.is_open:
            self._run(self.batcher.hold())
            self.is_open = False

    def stop(self) -> None:
        self._run(self.batcher.stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)
        self._executor.shutdown(wait=False)

    def _run(self, coroutine) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result()

    # -- one worker's pipe (its reader thread; the futures on the loop) ---------------------------

    def _read(self, connection: Connection) -> None:
        waiting: dict[int, asyncio.Future] = {}
        while True:
            try:
                kind, number, *payload = connection.recv()
            except (EOFError, OSError):
                break
            if kind == "submit":
                self.loop.call_soon_threadsafe(self._submit, connection, waiting, number, *payload)
            else:
                self.loop.call_soon_threadsafe(self._cancel, waiting, number)
        with contextlib.suppress(RuntimeError):  # the loop has stopped: nothing is waiting
            self.loop.call_soon_threadsafe(self._cancel_all, waiting)

    def _submit(
        self,
        connection: Connection,
        waiting: dict[int, asyncio.Future],
        number: int,
        prompts: list[list[int]],
        params: SamplingParams,
    ) -> None:
        future = self.batcher.submit(prompts, params)
        waiting[number] = future
        future.add_done_callback(functools.partial(self._answer, connection, waiting, number))

    @staticmethod
    def _answer(
        connection: Connection, waiting: dict[int, asyncio.Future], number: int, future: asyncio.Future
    ) -> None:
        waiting.pop(number, None)
        if future.cancelled():
            return
        error = future.exception()
        if error is None:
            message = ("done", number, future.result())
        elif isinstance(error, RequestError):
            message = ("error", number, (error.message, error.status, error.param))
        else:
            message = ("error", number, (f"generation failed: {type(error).__name__}: {error}", 500, None))
        with contextlib.suppress(OSError, ValueError):  # the worker is gone: nobody reads it
            connection.send(message)

    @staticmethod
    def _cancel(waiting: dict[int, asyncio.Future], number: int) -> None:
        future = waiting.pop(number, None)
        if future is not None:
            future.cancel()

    @staticmethod
    def _cancel_all(waiting: dict[int, asyncio.Future]) -> None:
        for future in list(waiting.values()):
            future.cancel()
        waiting.clear()


@dataclass(kw_only=True)
class RelayedEngine:
    """The engine as a worker's app sees it: the training process's engine's capabilities (its
    module left there) and weight version; it generates through the app's RelayedBatcher, and its
    owner, the training process, updates, sleeps and closes it."""

    capabilities: EngineCapabilities
    shares_policy_weights: bool = False
    holds_base: bool = False
    policy_version: int = 0
    stats: EngineStats = field(default_factory=EngineStats)

    def close(self) -> None:
        """Nothing: the training process owns the engine."""


class RelayedBatcher(Batcher):
    """A worker's batcher: its requests go to the training process's (module docstring). Its own
    gate is not consulted: the training process's gates every request."""

    def __init__(self, engine: RelayedEngine, connection: Connection) -> None:
        super().__init__(engine, window_s=0)
        self.connection = connection
        self._waiting: dict[int, asyncio.Future] = {}
        self._numbers = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None

    def start(self) -> None:
        """Start reading answers (inside the running event loop)."""
        self._loop = asyncio.get_running_loop()
        threading.Thread(target=self._read, name="grpoflow-relayed-answers", daemon=True).start()

    async def stop(self) -> None:
        self._fail_all("the server is shutting down", 503)

    def submit(self, prompts: list[list[int]], params: SamplingParams) -> asyncio.Future:
        """Send the request; the future gets one list of `params.n` completions per prompt, or a
        RequestError. Cancel the future to withdraw the request."""
        future = asyncio.get_running_loop().create_future()
        number = next(self._numbers)
        self._waiting[number] = future
        future.add_done_callback(functools.partial(self._on_done, number))
        try:
            self.connection.send(("submit", number, prompts, params))
        except (OSError, ValueError):
            self._settle(number, "error", (f"the engine cannot be reached: {WORKER_GONE}", 503, None))
        return future

    @property
    def busy(self) -> bool:
        return bool(self._waiting)

    def _on_done(self, number: int, future: asyncio.Future) -> None:
        if self._waiting.pop(number, None) is not None and future.cancelled():
            with contextlib.suppress(OSError, ValueError):
                self.connection.send(("cancel", number))

    def _read(self) -> None:
        while True:
            try:
                kind, number, payload = self.connection.recv()
            except (EOFError, OSError):
                break
            self._loop.call_soon_threadsafe(self._settle, number, kind, payload)
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits
            self._loop.call_soon_threadsafe(self._fail_all, "the training process's engine went away", 503)

    def _settle(self, number: int, kind: str, payload: Any) -> None:
        future = self._waiting.pop(number, None)
        if future is None or future.done():
            return
        if kind == "done":
            future.set_result(payload)
        else:
            future.set_exception(RequestError(*payload))

    def _fail_all(self, message: str, status: int) -> None:
        for number in list(self._waiting):
            self._settle(number, "error", (message, status, None))


@dataclass(frozen=True, kw_only=True)
class RelayedServer:
    """What a worker builds its app from (sent to it pickled): the hosted server's settings and
    limits, the tokenizer, the engine's capabilities and the served model's config."""

    config: ServeConfig
    limits: Limits
    tokenizer: Any
    capabilities: EngineCapabilities
    model_config: Any
    """The served model's transformers config: the worker builds the model on the meta device."""
    dtype: torch.dtype


def relayed_server(
    engine: RolloutEngine, tokenizer, *, model_name: str, max_model_len: int, **options: Any
) -> tuple[RelayedServer, torch.device]:
    """The app workers serve `engine` with (`options`: hosted_config's), and the engine's device."""
    model = served_module(engine)
    device = engine_device(model)
    config = hosted_config(engine, device, model_name=model_name, max_model_len=max_model_len, **options)
    server = RelayedServer(
        config=config,
        limits=served_limits(config, model, tokenizer, max_model_len),
        tokenizer=tokenizer,
        capabilities=dataclasses.replace(engine.capabilities, module=None),
        model_config=model.config,
        dtype=next(model.parameters()).dtype,
    )
    return server, device


class RelayedApp(ServedApp):
    """A worker's app, on an event loop of its own thread; its batcher relays to the engine."""

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.service.stop(), self.loop).result(timeout=10)
        self.loop.call_soon_threadsafe(self.loop.stop)


def serve_relayed(server: RelayedServer, connection: Connection) -> RelayedApp:
    """Build and start, in a worker, the app whose engine calls go down `connection`."""
    from transformers import AutoModelForCausalLM

    from grpoflow.server.app import build_app

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(server.model_config).to(server.dtype)
    engine = RelayedEngine(capabilities=server.capabilities)
    service = Service(
        config=server.config,
        engine=engine,
        model=model,
        device=torch.device("cpu"),
        tokenizer=server.tokenizer,
        limits=server.limits,
        batcher=RelayedBatcher(engine, connection),
    )
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, name="grpoflow-worker-server", daemon=True).start()
    asyncio.run_coroutine_threadsafe(_start(service), loop).result()
    return RelayedApp(
        url="http://agent-worker",
        api_key=server.config.api_key,
        model_name=server.limits.model_name,
        service=service,
        loop=loop,
        app=build_app(service, engine_routes=False),
    )


async def _start(service: Service) -> None:
    service.start()
