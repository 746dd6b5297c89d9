"""`grpoflow serve`'s app hosted around an engine another part of the process owns: a training
run's in-process engine, served to the run's agent programs on 127.0.0.1.

uvicorn runs in a daemon thread with an event loop of its own, on a free port, behind a random API
key. The engine is borrowed, never closed, and shared with its owner through the batcher's gate:
`open()` lets requests reach the engine, `close()` stops new batches and returns once the running
one has finished. The owner keeps the gate closed whenever it uses the engine itself (a weight
update, sleep, its own generation), so the two never run the engine at once; requests arriving
meanwhile wait for the next `open()`. The batcher's engine calls run in one worker thread that
has the engine's CUDA device as its current device.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import secrets
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch

from grpoflow.engines.base import EngineStats, RolloutEngine
from grpoflow.server.build import served_limits
from grpoflow.server.errors import RequestError
from grpoflow.server.in_process import InProcessConnections
from grpoflow.server.service import Service
from grpoflow.server.settings import ServeConfig

logger = logging.getLogger("grpoflow.server")

STARTUP_TIMEOUT_S = 60.0


class BorrowedEngine:
    """An engine seen through the server: it generates, takes weights, sleeps and wakes up as the
    engine, whose version and stats it shows, but the server cannot close it (its owner does)."""

    def __init__(self, engine: RolloutEngine) -> None:
        self._engine = engine
        self.capabilities, self.shares_policy_weights = engine.capabilities, engine.shares_policy_weights
        self.generate, self.update_weights = engine.generate, engine.update_weights
        self.sleep, self.wake_up = engine.sleep, engine.wake_up
        self.reset_prefix_cache = engine.reset_prefix_cache

    @property
    def policy_version(self) -> int:
        return self._engine.policy_version

    @policy_version.setter
    def policy_version(self, version: int) -> None:
        self._engine.policy_version = version

    @property
    def holds_base(self) -> bool:
        return self._engine.holds_base

    @property
    def stats(self) -> EngineStats:
        return self._engine.stats

    def close(self) -> None:
        """Nothing: the owner closes its engine."""


@dataclass(kw_only=True)
class ServedApp:
    """`grpoflow serve`'s app around a service, run on an event loop of its own thread, which
    clients in the same process call with no socket (in_process.py)."""

    url: str
    """The base URL its clients are given (the OpenAI base URL is `url + "/v1"`)."""
    api_key: str
    model_name: str
    service: Service
    loop: asyncio.AbstractEventLoop
    app: Any
    """The ASGI app (what in-process clients call directly)."""

    def connections(self) -> InProcessConnections:
        """Transports that hand requests to the app in its loop, with no socket (in_process.py)."""
        return InProcessConnections(self.app, self.loop)

    async def take_episode(self, episode_id: str) -> list[dict[str, Any]]:
        """The recorded turns of `episode_id` as GET /v1/episodes/ID gives them, then deleted; []
        when it recorded none. Awaited from any loop; the recorder is read in the server's."""
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(self._take(episode_id), self.loop))

    async def _take(self, episode_id: str) -> list[dict[str, Any]]:
        episodes = self.service.episodes
        try:
            turns = episodes.turns("", episode_id)
        except RequestError:  # none recorded
            return []
        episodes.drop("", episode_id)
        return [json.loads(turn.to_json(index)) for index, turn in enumerate(turns)]


@dataclass(kw_only=True)
class HostedServer(ServedApp):
    """A running hosted server: where it listens, its key, and its gate (module docstring)."""

    server: Any
    """The uvicorn.Server."""
    thread: threading.Thread
    is_open: bool = False

    def open(self) -> None:
        """Let requests reach the engine."""
        if not self.is_open:
            self._run(self.service.batcher.release())
            self.is_open = True

    def close(self) -> None:
        """Start no new batch; returns once the running one has finished."""
        if self.is_open:
            self._run(self.service.batcher.hold())
            self.is_open = False

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)

    def _run(self, coroutine) -> None:
        asyncio.run_coroutine_threadsafe(coroutine, self.loop).result()


def hosted_config(
    engine: RolloutEngine,
    device: torch.device,
    *,
    model_name: str,
    max_model_len: int,
    tool_call_parser: str = "auto",
    max_recorded_episodes: int = 1024,
    port: int | None = None,
) -> ServeConfig:
    """The settings of the server hosting `engine` for a run's agent programs (`port`: where it
    listens, if it does)."""
    return ServeConfig(
        model=model_name,
        engine=engine.capabilities.name,
        host="127.0.0.1",
        **({} if port is None else {"port": port}),
        api_key=secrets.token_urlsafe(24),
        max_model_len=max_model_len,
        device=device.type if device.type in ("cpu", "cuda") else "auto",
        tool_call_parser=tool_call_parser,
        max_recorded_episodes=max_recorded_episodes,
        trust_request_chat_template=True,  # its only clients are programs the run already runs,
        template_workers=0,  # so their templates render in-process, compiled once
    )


def host_engine(
    engine: RolloutEngine,
    tokenizer,
    *,
    model_name: str,
    max_model_len: int,
    tool_call_parser: str = "auto",
    max_recorded_episodes: int = 1024,
) -> HostedServer:
    """Serve `engine` as `model_name` on 127.0.0.1, its gate closed until `open()`."""
    import uvicorn

    from grpoflow.server.app import build_app

    model = served_module(engine)
    device = engine_device(model)

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = hosted_config(
        engine,
        device,
        model_name=model_name,
        max_model_len=max_model_len,
        tool_call_parser=tool_call_parser,
        max_recorded_episodes=max_recorded_episodes,
        port=port,
    )
    limits = served_limits(config, model, tokenizer, max_model_len)
    service = Service(
        config=config,
        engine=BorrowedEngine(engine),
        model=model,
        device=device,
        tokenizer=tokenizer,
        limits=limits,
    )
    app = build_app(service)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    loop = asyncio.new_event_loop()
    loop.set_default_executor(engine_executor(device))
    thread = threading.Thread(
        target=_serve, args=(loop, server, sock), name="grpoflow-hosted-server", daemon=True
    )
    thread.start()
    _wait_until_started(server, thread)
    hosted = HostedServer(
        url=f"http://127.0.0.1:{port}",
        api_key=config.api_key,
        model_name=model_name,
        service=service,
        server=server,
        thread=thread,
        loop=loop,
        app=app,
        is_open=True,
    )
    hosted.close()
    logger.info("serving the policy to agent programs at %s/v1", hosted.url)
    return hosted


def _serve(loop: asyncio.AbstractEventLoop, server, sock: socket.socket) -> None:
    asyncio.set_event_loop(loop)
    loop.run_until_complete(server.serve(sockets=[sock]))


def engine_executor(device: torch.device) -> concurrent.futures.ThreadPoolExecutor:
    """One worker thread for the batcher's engine calls, on the engine's CUDA device."""

    def on_device() -> None:
        if device.type == "cuda":
            torch.cuda.set_device(device)

    return concurrent.futures.ThreadPoolExecutor(
        max_workers=1, thread_name_prefix="grpoflow-hosted-engine", initializer=on_device
    )


def _wait_until_started(server, thread: threading.Thread) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the policy server for agent programs did not start (see the log above)")
        time.sleep(0.01)


def served_module(engine: RolloutEngine) -> torch.nn.Module:
    """The module the engine generates from; for an engine with its own weights (vLLM), its model
    on the meta device (names and shapes)."""
    capabilities = engine.capabilities
    if capabilities.module is not None:
        return capabilities.module
    if capabilities.model_dir is None:
        raise ValueError(
            f"the {capabilities.name} engine generates on servers of its own: it cannot be hosted"
        )
    from grpoflow.server.vllm_backend import meta_module

    return meta_module(str(capabilities.model_dir), trust_remote_code=False)


def on_cuda(engine: RolloutEngine) -> bool:
    """Whether `engine` generates on a CUDA device (an engine with weights of its own, vLLM's:
    whether CUDA is available)."""
    module = engine.capabilities.module
    if module is None:
        return torch.cuda.is_available()
    return engine_device(module).type == "cuda"


def engine_device(module: torch.nn.Module) -> torch.device:
    device = next(module.parameters()).device
    if device.type != "meta":
        return device
    return (
        torch.device("cuda", torch.cuda.current_device())
        if torch.cuda.is_available()
        else torch.device("cpu")
    )
