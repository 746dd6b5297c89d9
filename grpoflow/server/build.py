"""Build a rollout server from its settings, and run it."""

from __future__ import annotations

import dataclasses
import logging

import torch

from grpoflow.engines import EngineOptions, RolloutEngine, build_engine
from grpoflow.engines.native.sizing import NativeEngineConfig
from grpoflow.policy.loading import PolicyConfig, load_model, load_tokenizer, resolve_device
from grpoflow.server.protocol import Limits
from grpoflow.server.service import Service
from grpoflow.server.settings import ServeConfig

logger = logging.getLogger("grpoflow.server")

SHUTDOWN_GRACE_S = 10
"""Seconds SIGTERM waits for open requests (a join or a long generation) before the server exits."""
DEFAULT_MAX_MODEL_LEN = 2048
"""Context of a model that states none (no max_position_embeddings)."""


def build_service(config: ServeConfig) -> Service:
    """Load the tokenizer and the model and build the engine that serves them."""
    tokenizer = load_tokenizer(config.model, trust_remote_code=config.trust_remote_code)
    if config.engine == "vllm":
        model, engine, device, max_model_len = _vllm_parts(config, tokenizer)
    else:
        model, engine, device, max_model_len = _in_process_parts(config, tokenizer)
    limits = served_limits(config, model, tokenizer, max_model_len)
    logger.info(
        "serving %s as %r with the %s engine on %s, max_model_len %d",
        config.model,
        limits.model_name,
        config.engine,
        device,
        max_model_len,
    )
    return Service(
        config=config, engine=engine, model=model, device=device, tokenizer=tokenizer, limits=limits
    )


def served_limits(config: ServeConfig, model: torch.nn.Module, tokenizer, max_model_len: int) -> Limits:
    """What requests to a server of `config` serving `model` may ask for."""
    output = model.get_output_embeddings()
    return Limits(
        model_name=config.model_name,
        max_model_len=max_model_len,
        vocab_size=output.weight.shape[0] if output is not None else len(tokenizer),
        eos_token_ids=eos_token_ids(model, tokenizer),
        max_sequences=config.max_sequences_per_request,
        max_prompt_chars=config.max_prompt_chars or 32 * max_model_len,
        trust_request_chat_template=config.trust_request_chat_template,
    )


def _in_process_parts(
    config: ServeConfig, tokenizer
) -> tuple[torch.nn.Module, RolloutEngine, torch.device, int]:
    """The native or hf engine around the model it generates from, loaded on the server's device."""
    device = resolve_device(config.device)
    dtype = "auto" if config.dtype == "auto" else getattr(torch, config.dtype)
    policy = PolicyConfig(model=config.model, trust_remote_code=config.trust_remote_code)
    model = load_model(
        config.model, policy, vocab_size=len(tokenizer), seed=config.seed, device=device, dtype=dtype
    )
    model.eval().requires_grad_(False)
    max_model_len = config.max_model_len or model_context(model)
    engine_config = dataclasses.replace(config, max_model_len=max_model_len)
    if config.engine == "native":  # the sizes, and the largest adapter rank it takes
        engine_config = dataclasses.replace(
            NativeEngineConfig.sized_as(engine_config), max_lora_rank=config.max_lora_rank
        )
    options = EngineOptions(engine=engine_config)
    return model, build_engine(config.engine, model, tokenizer, options), device, max_model_len


def _vllm_parts(config: ServeConfig, tokenizer) -> tuple[torch.nn.Module, RolloutEngine, torch.device, int]:
    """vLLM's engine, which holds the weights, and the model's meta module for checking updates."""
    from grpoflow.server import vllm_backend

    source = vllm_backend.prepare(config, tokenizer)
    max_model_len = config.max_model_len or model_context(source.module)
    engine = vllm_backend.build_vllm_engine(config, source, max_model_len)
    return source.module, engine, source.device, max_model_len


def eos_token_ids(model: torch.nn.Module, tokenizer) -> tuple[int, ...]:
    """The tokenizer's EOS and the model's generation-config EOS ids, in that order, once each."""
    ids = [tokenizer.eos_token_id]
    generation = getattr(model, "generation_config", None)
    configured = getattr(generation, "eos_token_id", None)
    ids += configured if isinstance(configured, list) else [configured]
    return tuple(dict.fromkeys(int(token) for token in ids if token is not None))


def model_context(model: torch.nn.Module) -> int:
    """The model's stated context (max_position_embeddings), else DEFAULT_MAX_MODEL_LEN."""
    config = model.config
    stated = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    return stated or DEFAULT_MAX_MODEL_LEN


def exposure_warning(config: ServeConfig) -> str | None:
    """What to tell the operator of a server that listens beyond loopback without a key."""
    if not config.exposed or config.api_key or config.api_key_file:
        return None
    return (
        f"listening on {config.host} without --api-key: anyone who reaches port {config.port} can "
        f"generate, pause the server and replace its weights; set --api-key KEY (clients send it as a "
        f"bearer token; trainers read vllm_server_api_key or VLLM_API_KEY) or listen on 127.0.0.1"
    )


def serve(config: ServeConfig) -> None:
    """Build the server and answer requests until interrupted."""
    import uvicorn

    from grpoflow.server.app import build_app
    from grpoflow.server.connections import header_deadline

    warning = exposure_warning(config)
    if warning is not None:
        logger.warning(warning)
    app = build_app(build_service(config))
    uvicorn.run(
        app,
        host=config.host,
        port=config.port,
        log_level="info",
        http=header_deadline(config.header_timeout_s),
        timeout_keep_alive=5,
        timeout_graceful_shutdown=SHUTDOWN_GRACE_S,
    )
