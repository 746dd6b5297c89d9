"""What the endpoints share: the engine and its model, the batcher, the weight version; and the
helpers every handler uses to read a request."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from starlette.requests import Request
from torch import nn

from grpoflow.chat.tool_calls import resolve_tool_call_format
from grpoflow.engines.base import Completion, EngineCapabilities, RolloutEngine, SamplingParams
from grpoflow.server.batcher import Batcher
from grpoflow.server.episode_recorder import EpisodeRecorder
from grpoflow.server.errors import RequestError
from grpoflow.server.holds import Holds
from grpoflow.server.memory import QuietTrimmer
from grpoflow.server.pools import Pools, run_in
from grpoflow.server.protocol import Limits
from grpoflow.server.settings import ServeConfig
from grpoflow.server.templates import TemplateSandbox
from grpoflow.transport import ReceiveError
from grpoflow.transport.adapters import adapter_shapes, check_pairs, is_adapter_name, ranks_of
from grpoflow.transport.collective_receiver import CollectiveReceiver, Write, into_load, into_parameters

MAX_JSON_BYTES = 64 * 2**20
"""Largest JSON body the server reads; weights travel as safetensors bodies, not JSON."""
MAX_VERSION_CHARS = 64
"""Longest weight version a server records."""
LOOP_JSON_BYTES = 64 * 2**10
"""JSON bodies up to this size are parsed on the event loop; larger ones in a request thread."""
YIELDING_JSON_BYTES = 2**20
"""JSON bodies over this size are parsed one at a time (pools.py's `bodies`), with a Python hook per
integer: json's C parser holds the GIL for a whole body (a second per 20 MB of token ids, during
which the event loop cannot answer even /health), while the hook lets the interpreter switch
threads every few milliseconds, at three times the parse's cost."""
DISCONNECT_POLL_S = 0.25
"""How often a waiting request checks that its client is still there."""
CALL_SEQUENCES_PER_ROW = 4
"""A running engine call takes joining requests up to this many sequences per --max-num-seqs row
(the batcher's `call_sequences`): its per-sequence bookkeeping lives until the call ends."""


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
    """What turns requests into engine calls: made by `start`, or given (a worker process's app
    relays its requests to the batcher of the process that owns the engine: relay.py)."""
    holds: Holds | None = field(default=None)
    """The open weight update and the pause, with their leases (holds.py)."""
    pools: Pools = field(init=False)
    """The engine's and the requests' worker threads (pools.py)."""
    episodes: EpisodeRecorder = field(init=False)
    """The agent episodes recorded from chat requests that name one (episode_recorder.py)."""
    templates: TemplateSandbox | None = field(init=False)
    """Where chat templates sent in requests render, when the server trusts them (templates.py)."""
    large_bodies: int = 0
    """Request bodies read that were too large to parse on the event loop (refused ones included)."""
    trimmer: QuietTrimmer | None = field(default=None)
    """Gives the heap's free memory back once the server is quiet after work (memory.py)."""
    tool_call_format: str = field(init=False)
    """The format chat answers' tool calls are read in: --tool-call-parser, or with `auto` the one
    the tokenizer's chat template renders (grpoflow.chat.tool_calls)."""

    def __post_init__(self) -> None:
        self.pools = Pools(self.config.request_threads)
        self.tool_call_format = resolve_tool_call_format(self.config.tool_call_parser, self.tokenizer)
        self.templates = None
        if self.config.trust_request_chat_template and self.config.template_workers > 0:
            self.templates = TemplateSandbox(
                timeout_s=self.config.template_timeout_s,
                max_chars=self.limits.max_prompt_chars,
                workers=self.config.template_workers,
                wait_s=self.config.template_wait_s,
            )
        self.receiver = CollectiveReceiver(self.device)
        self.episodes = EpisodeRecorder(
            max_episodes=self.config.max_recorded_episodes,
            max_turns=self.config.max_episode_turns,
            max_bytes=self.config.max_episode_bytes,
            max_total_bytes=self.config.max_recorded_bytes,
        )

    def start(self) -> None:
        """Create the batcher (unless one was given) and the holds inside the running event loop."""
        if self.batcher is None:
            self.batcher = Batcher(
                self.engine,
                window_s=self.config.batch_window_ms / 1000,
                executor=self.pools.engine,
                call_sequences=CALL_SEQUENCES_PER_ROW * self.config.max_num_seqs,
            )
        self.holds = Holds(self.batcher, self.config.hold_lease_s, lambda: self.pending_weights.clear())
        self.batcher.start()
        batcher = self.batcher
        self.trimmer = QuietTrimmer(
            lambda: batcher.num_engine_calls + self.large_bodies,
            lambda: batcher.busy,
            self.pools.engine,
            self.config.trim_quiet_s,
        )
        self.trimmer.start()

    @property
    def update_open(self) -> bool:
        """Between /start_weight_update and /finish_weight_update (generation held)."""
        return self.holds is not None and self.holds.update_open

    async def stop(self) -> None:
        if self.trimmer is not None:
            self.trimmer.stop()
        if self.batcher is not None:
            await self.batcher.stop()
        self.receiver.close()
        if self.templates is not None:
            self.templates.close()
        await run_in(self.pools.engine, self.engine.close)
        self.pools.shutdown()

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

    def parameters(self) -> dict[str, torch.Tensor]:
        """Every parameter by Hugging Face name (tied names too): values an update may hold must fit
        its dtype and magnitude (`grpoflow.transport.weight_values`)."""
        return dict(self.model.named_parameters(remove_duplicate=False))

    def update_shapes(self, given: Mapping[str, Sequence[int]]) -> dict[str, Sequence[int]]:
        """`parameter_shapes`, plus the shapes of the LoRA adapter tensors among the `given`
        names (their rank read from the given shapes): what an update of those names is checked
        against. ReceiveError 400 for adapters the engine does not take (`check_adapters`)."""
        shapes: dict[str, Sequence[int]] = dict(self.parameter_shapes())
        adapters = [name for name in given if is_adapter_name(name)]
        if adapters:
            if not self.engine.capabilities.accepts_adapters:
                raise ReceiveError(NO_ADAPTERS.format(name=adapters[0]))
            check_pairs(given)
            ranks = ranks_of(given)
            linear = {
                name: m.weight.shape for name, m in self.model.named_modules() if isinstance(m, nn.Linear)
            }
            shapes.update(adapter_shapes(adapters, ranks, linear))
            check_adapters(self.engine.capabilities, ranks)
        return shapes

    def max_weights_bytes(self) -> int:
        """The largest safetensors body /update_weights reads (--max-weights-bytes, else the whole
        model in float32 plus 16 MiB of headers)."""
        if self.config.max_weights_bytes is not None:
            return self.config.max_weights_bytes
        return 4 * sum(p.numel() for p in self.model.parameters()) + 16 * 2**20

    def weight_writer(self) -> Write:
        """Where a collective update lands once received and checked: copied into the
        parameters when the engine generates from the module and takes no adapters (the in-place
        writes move the parameters' versions, so its prefix cache is dropped), else handed to the
        engine's `update_weights` in one call: an engine that takes adapters learns from every
        update which layers' base weights arrived without one."""
        engine = self.engine
        if engine.shares_policy_weights and not engine.capabilities.accepts_adapters:
            return into_parameters(self.parameters())
        return into_load(lambda pairs: engine.update_weights(pairs, engine.policy_version), self.parameters())

    def set_version(self, version: str) -> None:
        """Record the weight version (checked first with `check_version`); engines number
        completions with it when it is an integer."""
        self.weight_version = check_version(version)
        if self.weight_version.lstrip("-").isdigit():
            self.engine.policy_version = int(self.weight_version)


NO_ADAPTERS = (
    "the update holds LoRA adapter tensors ({name}, ...), which this server's engine does not take: "
    "send the merged weights (grpoflow's trainer does when /server_info's adapter_updates is "
    "false), or serve with --engine native, or --engine vllm --enable-lora"
)


def check_adapters(capabilities: EngineCapabilities, ranks: Mapping[str, int]) -> None:
    """ReceiveError 400 when an adapter (module: rank) is above the engine's `max_adapter_rank`
    or adapts a layer outside its `adaptable_modules` (vLLM would take it, then fail to load it
    at the next generation)."""
    limit = capabilities.max_adapter_rank
    over = {module: rank for module, rank in ranks.items() if limit is not None and rank > limit}
    if over:
        module, rank = max(over.items(), key=lambda item: item[1])
        raise ReceiveError(
            f"the adapter of {module} has rank {rank}, above this server's --max-lora-rank {limit}: "
            f"restart the server with --max-lora-rank {rank} or more (a grpoflow trainer reads it "
            f"from /server_info and sends the merged weights instead)"
        )
    allowed = capabilities.adaptable_modules
    refused = [module for module in ranks if allowed is not None and module.rsplit(".", 1)[-1] not in allowed]
    if refused:
        raise ReceiveError(
            f"{refused[0]} cannot carry a LoRA adapter on this server's engine, which adapts "
            f"{', '.join(sorted(allowed))}: leave it out of target_modules"
        )


def check_version(version: Any, field: str = "weight_version") -> str:
    """A weight version as the server keeps it: a string or an integer of at most
    MAX_VERSION_CHARS characters; a 400 naming `field` otherwise. Handlers check it before they
    apply anything, so a bad version never leaves an update half-applied."""
    if isinstance(version, bool) or not isinstance(version, str | int):
        raise RequestError(
            f"{field} must be a string or an integer, got {type(version).__name__}", 400, field
        )
    if isinstance(version, int) and abs(version) >= 10**MAX_VERSION_CHARS:
        raise RequestError(f"{field} is longer than {MAX_VERSION_CHARS} digits", 400, field)
    text = str(version)
    if not 1 <= len(text) <= MAX_VERSION_CHARS:
        raise RequestError(f"{field} must have 1 to {MAX_VERSION_CHARS} characters", 400, field)
    return text


def service_of(request: Request) -> Service:
    return request.app.state.service


def client_of(request: Request, body: Any) -> str:
    """Who a hold belongs to: the body's `client_id` when it sends one, else the client's address
    (so a trainer restarted on the same machine takes its own update back)."""
    named = body.get("client_id") if isinstance(body, dict) else None
    if isinstance(named, str) and 0 < len(named) <= 256:
        return named
    return request.client.host if request.client else "unknown"


async def read_body(request: Request, limit: int, why: str = "") -> bytes:
    """The raw body, read as it streams in; a 413 as soon as it passes `limit` bytes (or declares
    more), so an oversized body is never held in memory. `why` explains the limit in the answer."""
    declared = request.headers.get("content-length")
    why = f" ({why})" if why else ""
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise RequestError(f"the body has {declared} bytes, over the limit of {limit}{why}", 413)
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise RequestError(f"the body is over the limit of {limit} bytes{why}", 413)
            chunks.append(chunk)
    finally:
        if size > LOOP_JSON_BYTES:
            service_of(request).large_bodies += 1
    return b"".join(chunks)


async def read_json(
    request: Request, *, required: bool = True, limit: int = MAX_JSON_BYTES, why: str = ""
) -> Any:
    """The body as JSON; a 400 for malformed JSON, a 413 past `limit` bytes (MAX_JSON_BYTES unless
    the endpoint takes less; `why` says why in the answer)."""
    body = await read_body(request, limit, why)
    if not body.strip():
        if required:
            raise RequestError("the request has no body: send a JSON object")
        return {}
    if len(body) <= LOOP_JSON_BYTES:
        return parse_json(body)
    pools = service_of(request).pools
    return await run_in(pools.bodies if len(body) > YIELDING_JSON_BYTES else pools.requests, parse_json, body)


def _integer(text: str) -> int:
    return int(text)


def parse_json(body: bytes) -> Any:
    """The body as JSON; a 400 for anything json.loads refuses, nesting too deep to parse, or
    integers too long to convert. A body over YIELDING_JSON_BYTES is parsed so that other threads
    (the event loop's) run meanwhile."""
    try:
        if len(body) > YIELDING_JSON_BYTES:
            return json.loads(body, parse_int=_integer)
        return json.loads(body)
    except RecursionError:
        raise RequestError("the body is nested too deeply to parse") from None
    except ValueError as error:  # JSONDecodeError, UnicodeDecodeError, int digit limits
        raise RequestError(f"the body is not valid JSON: {error}") from None
