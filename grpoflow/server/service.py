"""What the endpoints share: the engine and its model, the batcher, the weight version; and the
helpers every handler uses to read a request."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any

import torch
from starlette.requests import Request

from grpoflow.engines.base import Completion, RolloutEngine, SamplingParams
from grpoflow.server.batcher import Batcher
from grpoflow.server.episodes import EpisodeRecorder
from grpoflow.server.errors import RequestError
from grpoflow.server.protocol import Limits
from grpoflow.server.settings import ServeConfig
from grpoflow.transport.collective_receiver import CollectiveReceiver, Write, into_load, into_parameters

MAX_JSON_BYTES = 64 * 2**20
"""Largest JSON body the server reads; weights travel as safetensors bodies, not JSON."""
DISCONNECT_POLL_S = 0.25
"""How often a waiting request checks that its client is still there."""


class ClientGone(Exception):
    """The client closed the connection before its answer was ready."""


@dataclass(kw_only=True)
class Service:
    """The served model and everything about it that outlives a request."""

    config: ServeConfig
    engine: RolloutEngine
    model: torch.nn.Module
    """The served model's module: the one the engine generates from (native, hf), or, when the
    engine holds its own copy of the weights (vllm), a module on the meta device that only names
    the parameters and gives their shapes and dtype."""
    device: torch.device
    """Where the engine generates (and collective transfers land)."""
    tokenizer: Any
    limits: Limits
    weight_version: str = "0"
    update_open: bool = False
    """Between /start_weight_update and /finish_weight_update (generation held)."""
    transfer_backend: str | None = None
    """Set by /init_weight_transfer_engine: http, gloo or nccl."""
    receiver: CollectiveReceiver = field(init=False)
    """This server's rank in the trainer's collective weight-transfer group, once joined through
    /init_weight_transfer_engine."""
    pending_weights: dict[str, torch.Tensor] = field(default_factory=dict)
    """Tensors of the open update kept for /finish_weight_update, for engines that reload whole
    layers (vllm: a fused layer loaded from part of its tensors would lose the rest)."""
    sleeping: bool = False
    batcher: Batcher | None = field(default=None)
    episodes: EpisodeRecorder = field(init=False)
    """The agent episodes recorded from chat requests that name one (episodes.py)."""

    def __post_init__(self) -> None:
        self.receiver = CollectiveReceiver(self.device)
        self.episodes = EpisodeRecorder(self.config.max_recorded_episodes)

    def start(self) -> None:
        """Create the batcher inside the running event loop."""
        self.batcher = Batcher(self.engine, window_s=self.config.batch_window_ms / 1000)
        self.batcher.start()

    async def stop(self) -> None:
        if self.batcher is not None:
            await self.batcher.stop()
        self.receiver.close()
        close = getattr(self.engine, "close", None)
        if close is not None:
            await asyncio.to_thread(close)

    async def generate(
        self, request: Request, prompts: list[list[int]], params: SamplingParams
    ) -> list[list[Completion]]:
        """Queue the prompts and wait for their completions; withdraws them if the client leaves."""
        future = self.batcher.submit(prompts, params)
        try:
            while True:
                done, _ = await asyncio.wait({future}, timeout=DISCONNECT_POLL_S)
                if done:
                    return future.result()
                if await request.is_disconnected():
                    raise ClientGone
        finally:
            future.cancel()  # a no-op once answered

    def parameter_shapes(self) -> dict[str, torch.Size]:
        """Every parameter's Hugging Face name (tied names too) and shape: what updates may hold."""
        return {name: p.shape for name, p in self.model.named_parameters(remove_duplicate=False)}

    def weight_writer(self) -> Write:
        """Where a collective update lands: straight in the parameters when the engine generates
        from the module, else in buffers handed to the engine's `update_weights` in one call."""
        if self.engine.shares_policy_weights:
            return into_parameters(dict(self.model.named_parameters(remove_duplicate=False)))
        engine = self.engine
        return into_load(lambda pairs: engine.update_weights(pairs, engine.policy_version))

    def set_version(self, version: str) -> None:
        """Record the weight version; engines number completions with it when it is an integer."""
        self.weight_version = str(version)
        if self.weight_version.lstrip("-").isdigit():
            self.engine.policy_version = int(self.weight_version)


def service_of(request: Request) -> Service:
    return request.app.state.service


async def read_json(request: Request, *, required: bool = True) -> Any:
    """The body as JSON; a 400 for malformed JSON, a 413 past MAX_JSON_BYTES."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > MAX_JSON_BYTES:
        raise RequestError(f"the body has {declared} bytes, over the limit of {MAX_JSON_BYTES}", 413)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_JSON_BYTES:
            raise RequestError(f"the body is over the limit of {MAX_JSON_BYTES} bytes", 413)
        chunks.append(chunk)
    body = b"".join(chunks)
    if not body.strip():
        if required:
            raise RequestError("the request has no body: send a JSON object")
        return {}
    try:
        return json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise RequestError(f"the body is not valid JSON: {error}") from None
