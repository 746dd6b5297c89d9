"""The FastAPI app of `grpoflow serve`: vLLM's OpenAI-compatible protocol on an in-process engine.

Endpoints (vLLM's names and shapes, so vLLM clients such as TRL's VLLMClient and grpoflow's
RemoteEngine drive it unchanged):

- /health, /ping, /version, /v1/models, /server_info, /get_world_size: what is served.
- /v1/completions (token-id or text prompts) and /v1/chat/completions (rendered by the chat
  template, with `tools`; tool calls answered in OpenAI's shape): batched across concurrent
  requests (see batcher.py).
- /v1/episodes, /v1/episodes/{id} (GET, DELETE, paged): the chat turns of agent episodes, recorded
  for requests that name an episode (`X-Episode-Id` header or `episode_id` field):
  episode_recorder.py, episode_routes.py.
- /generate: vLLM's demo API server endpoint as Atropos's VLLMServer calls it (token ids and the
  sampled tokens' log-probs of one prompt's n completions).
- /pause, /resume, /is_paused, /reset_prefix_cache, /sleep, /wake_up, /is_sleeping: control.py.
- /init_weight_transfer_engine, /start_weight_update, /update_weights, /finish_weight_update,
  /shutdown_weight_transfer_engine, /update_weight_version, /weight_info, /collective_rpc: weight
  updates over HTTP or broadcast over a gloo/NCCL group (weights.py, on grpoflow.transport's
  receivers).

With an API key (auth.py) every endpoint but /health, /ping and /version needs `Authorization:
Bearer KEY` (vLLM guards only /v1/...; here the weight and control endpoints are guarded too,
since they change what the server generates). Errors are `{"error": {"message", "type", "param", "code"}}`.
"""

from __future__ import annotations

import contextlib
import logging
from importlib import metadata
from typing import Any

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from grpoflow.server import continuation, control, episode_recorder, episode_routes, weights
from grpoflow.server.auth import BearerAuth, api_keys
from grpoflow.server.errors import RequestError
from grpoflow.server.pools import run_in
from grpoflow.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    GenerateRequest,
    Limits,
    chat_max_tokens,
    chat_messages,
    chat_text,
    check_prompts,
    completion_max_tokens,
    completion_prompts,
    generate_prompt,
    parse,
    sampling_params,
    sandbox_arguments,
)
from grpoflow.server.responses import chat_response, completion_response, generate_response
from grpoflow.server.service import ClientGone, Service, read_json, service_of
from grpoflow.transport import ReceiveError

logger = logging.getLogger("grpoflow.server")

CLIENT_CLOSED = 499
"""Status logged for a request whose client left (nobody reads the answer)."""
ONE_PROMPT_EXTRA_BYTES = 8 * 2**20
"""Room a body of one prompt has beyond the prompt: tools, stop strings, a chat template."""


def build_app(service: Service, *, engine_routes: bool = True) -> FastAPI:
    """The app serving `service`; its batcher starts and stops with the app. Without
    `engine_routes`, the control and weight endpoints are left out (an app whose engine another
    process owns and updates: grpoflow.server.relay)."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        service.start()
        try:
            yield
        finally:
            await service.stop()

    app = FastAPI(title="grpoflow serve", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.service = service
    keys = api_keys(service.config)
    if keys:
        app.add_middleware(BearerAuth, api_keys=keys)
    app.add_exception_handler(RequestError, _request_error)
    app.add_exception_handler(ReceiveError, _receive_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(ClientGone, _client_gone)
    app.add_api_route("/health", health, methods=["GET"])
    app.add_api_route("/ping", health, methods=["GET", "POST"])
    app.add_api_route("/version", version, methods=["GET"])
    app.add_api_route("/v1/models", models, methods=["GET"])
    app.add_api_route("/server_info", server_info, methods=["GET"])
    app.add_api_route("/get_world_size", world_size, methods=["GET"])
    app.add_api_route("/v1/completions", completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", chat_completions, methods=["POST"])
    app.add_api_route("/generate", generate, methods=["POST"])
    if engine_routes:
        app.include_router(control.router)
        app.include_router(weights.router)
    app.include_router(episode_routes.router)
    return app


async def _request_error(request: Request, error: RequestError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status)


async def _receive_error(request: Request, error: ReceiveError) -> JSONResponse:
    return await _request_error(request, RequestError(error.message, error.status, error.param))


async def _validation_error(request: Request, error: RequestValidationError) -> JSONResponse:
    return await _request_error(request, RequestError(f"invalid request: {error.errors()[:5]}"))


async def _client_gone(request: Request, error: ClientGone) -> Response:
    return Response(status_code=CLIENT_CLOSED)


# -- what is served ---------------------------------------------------------------------------


async def health() -> Response:
    return Response(status_code=200)


async def version() -> dict:
    try:
        return {"version": metadata.version("grpoflow")}
    except metadata.PackageNotFoundError:
        return {"version": "unknown"}


async def models(request: Request) -> dict:
    service = service_of(request)
    return {
        "object": "list",
        "data": [
            {
                "id": service.limits.model_name,
                "object": "model",
                "created": 0,
                "owned_by": "grpoflow",
                "root": service.config.model,
                "parent": None,
                "max_model_len": service.limits.max_model_len,
                "permission": [],
            }
        ],
    }


async def server_info(request: Request) -> dict:
    """vLLM's shape (`vllm_config` with the sections clients read) plus a `grpoflow` section."""
    service = service_of(request)
    config, limits = service.config, service.limits
    parameter = next(service.model.parameters())
    vllm_config = {
        "model_config": {
            "model": config.model,
            "served_model_name": limits.model_name,
            "max_model_len": limits.max_model_len,
            "dtype": str(parameter.dtype).removeprefix("torch."),
            "vocab_size": limits.vocab_size,
            "logprobs_mode": "processed_logprobs",
        },
        "parallel_config": {
            "tensor_parallel_size": 1,
            "pipeline_parallel_size": 1,
            "data_parallel_size": 1,
            "world_size": 1,
        },
        "scheduler_config": {"max_num_seqs": config.max_num_seqs},
        "cache_config": {"gpu_memory_utilization": config.gpu_memory_utilization},
        "weight_transfer_config": None,  # vLLM's PyNccl wire format is not spoken: TRL's client stops
    }
    batcher = service.batcher
    return {
        "vllm_config": vllm_config
        if request.query_params.get("config_format") == "json"
        else str(vllm_config),
        "grpoflow": {
            "engine": config.engine,
            "device": str(service.device),
            "weight_version": service.weight_version,
            "adapter_updates": service.engine.capabilities.accepts_adapters,
            "max_lora_rank": service.engine.capabilities.max_adapter_rank,
            "weight_transfer": {
                "backend": service.transfer_backend or "http",
                "backends": ["http", *service.receiver.offered_backends()],
                **service.holds.status(),
            },
            "is_paused": batcher.paused,
            "batching": {
                "window_ms": config.batch_window_ms,
                "per_prompt_params": batcher.per_prompt,
                "num_batches": batcher.num_batches,
                "num_engine_calls": batcher.num_engine_calls,
                "num_joined": batcher.num_joined,
            },
            "episodes": {
                "num_recorded": len(service.episodes),
                "max_recorded": config.max_recorded_episodes,
                "num_bytes": service.episodes.nbytes,
                "max_recorded_bytes": config.max_recorded_bytes,
                "max_episode_turns": config.max_episode_turns,
                "max_episode_bytes": config.max_episode_bytes,
                "num_dropped": service.episodes.num_dropped,
            },
            "tool_call_parser": service.tool_call_format,
        },
    }


async def world_size(request: Request) -> dict:
    return {"world_size": 1}


# -- generation -------------------------------------------------------------------------------


async def completions(request: Request) -> dict:
    service = service_of(request)
    limits = service.limits
    body = await parsed(request, CompletionRequest)
    _sampled_logprobs_only(body.logprobs)
    requests = service.pools.requests
    prompts = await run_in(requests, completion_prompts, body, service.tokenizer, limits)
    params = sampling_params(body, completion_max_tokens(body), limits)
    await run_in(requests, check_prompts, prompts, params.max_tokens, params.n, limits)
    groups = await service.generate(request, prompts, params)
    return await run_in(
        requests, completion_response, body, limits.model_name, prompts, groups, service.tokenizer
    )


async def chat_completions(request: Request) -> dict:
    service = service_of(request)
    limits = service.limits
    body = await parsed(request, ChatCompletionRequest, one_prompt=True)
    if body.logprobs and body.top_logprobs:
        raise RequestError(
            f"top_logprobs={body.top_logprobs}: grpoflow serve reports the sampled token's log-prob "
            f"only; send top_logprobs=0",
            400,
            "top_logprobs",
        )
    episode_id = episode_recorder.episode_id_of(request, body)
    requests = service.pools.requests
    text = await _chat_text(service, body)
    resume = episode_routes.resume_of(request, episode_id)
    prompt = await run_in(
        requests,
        continuation.prompt_ids,
        text,
        resume,
        service.tokenizer,
        bool(body.add_special_tokens),
        limits,
    )
    params = sampling_params(body, chat_max_tokens(body, prompt, limits), limits)
    await run_in(requests, check_prompts, [prompt], params.max_tokens, params.n, limits)
    turn = None if episode_id is None else await episode_routes.open_turn(request, episode_id, body, params)
    (group,) = await service.generate(request, [prompt], params)
    response = await run_in(
        requests,
        chat_response,
        body,
        limits.model_name,
        prompt,
        group,
        service.tokenizer,
        service.tool_call_format,
    )
    if turn is not None:
        await episode_routes.record_turn(request, turn, body, (text, prompt), group[0], response)
    return response


async def _chat_text(service: Service, body: ChatCompletionRequest) -> str:
    """The chat request's prompt as text: rendered in a request thread, but for a template of the
    request's own, which renders in the template sandbox's workers (templates.py)."""
    requests, tokenizer, limits = service.pools.requests, service.tokenizer, service.limits
    if body.chat_template is None or service.templates is None:
        return await run_in(requests, chat_text, body, tokenizer, limits)
    messages = await run_in(requests, chat_messages, body, tokenizer, limits)
    return await service.templates.render_soon(
        body.chat_template, messages, **sandbox_arguments(body, tokenizer)
    )


async def generate(request: Request) -> dict:
    service = service_of(request)
    limits = service.limits
    body = await parsed(request, GenerateRequest, one_prompt=True)
    _sampled_logprobs_only(body.logprobs)
    requests = service.pools.requests
    prompt = await run_in(requests, generate_prompt, body, service.tokenizer, limits)
    params = sampling_params(body, 16 if body.max_tokens is None else body.max_tokens, limits)
    await run_in(requests, check_prompts, [prompt], params.max_tokens, params.n, limits)
    (group,) = await service.generate(request, [prompt], params)
    return await run_in(requests, generate_response, body, prompt, group, service.tokenizer)


async def parsed(request: Request, model: type[BaseModel], *, one_prompt: bool = False) -> Any:
    """The request's body read as `model` and checked, off the event loop (a large body's
    validation would hold every other request and /health). A body of `one_prompt` (chat,
    /generate) is read up to `one_prompt_body_bytes`, so a body far larger than any prompt the
    model takes is refused before it is parsed."""
    service = service_of(request)
    if one_prompt:
        why = "one prompt at its longest, --max-prompt-chars or max_model_len, plus 8 MiB for the rest"
        body = await read_json(request, limit=one_prompt_body_bytes(service.limits), why=why)
    else:
        body = await read_json(request)
    return await run_in(service.pools.requests, parse, model, body, service.limits)


def one_prompt_body_bytes(limits: Limits) -> int:
    """The largest body /v1/chat/completions and /generate read: their prompt or conversation as
    JSON at its longest (6 bytes a character, written as \\uXXXX; 12 a token id) and
    ONE_PROMPT_EXTRA_BYTES for the rest (tools, stop strings, a chat template)."""
    return max(6 * limits.max_prompt_chars, 12 * limits.max_model_len) + ONE_PROMPT_EXTRA_BYTES


def _sampled_logprobs_only(logprobs: int | None) -> None:
    """Refuse top-N log-probs (`logprobs` > 0): only the sampled token's log-prob is reported."""
    if logprobs not in (None, 0):
        raise RequestError(
            f"logprobs={logprobs}: grpoflow serve reports the sampled token's log-prob only; "
            f"send logprobs=0 (or leave it out)",
            400,
            "logprobs",
        )
