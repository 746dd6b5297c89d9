"""What the rollout servers offer, and the weight transfer chosen from it.

`discover` asks every server for its model (/v1/models) and its /server_info (vLLM exposes it, and
/collective_rpc, only with `VLLM_SERVER_DEV_MODE=1`), warns when a server's log-probs are taken
before temperature, and finds the method each reloads a checkpoint with (grpoflow's worker
extension's when installed, else vLLM's own) and whether vLLM's own server loads LoRA adapters at
run time (`runtime_adapters`). `choose_transfer` takes `collective` when asked, or
under `auto` when every server offers it (grpoflow serve does, vLLM's own server does not) and the
trainer is a single process (or the servers are its alone); else `checkpoint`. `adapters_alone`
says whether a LoRA policy's adapters travel alone after the first sync (the servers' offers
against the policy's rank and layers).
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn

from grpoflow.distributed import launched_world_size
from grpoflow.engines.vllm import LOGPROBS_MODE
from grpoflow.engines.vllm_adapters import (
    adapter_obstacle,
    adapter_rank,
    expert_adapter_obstacle,
    lora_layers,
)
from grpoflow.remote.runtime_adapters import runtime_lora_rank
from grpoflow.transport import ServerError
from grpoflow.transport.checkpoint_sender import READY_METHOD, RELOAD_METHOD, VLLM_RELOAD_METHOD
from grpoflow.transport.server_client import ServerClient

logger = logging.getLogger("grpoflow.remote")


@dataclass(frozen=True, slots=True)
class ServerOffer:
    """What one rollout server serves and offers for weight updates."""

    url: str
    model: str
    """The served model's name, as completions requests give it."""
    reload_method: str | None
    """The /collective_rpc method it reloads a checkpoint with; None without dev mode."""
    collective: bool
    """Whether it joins a collective weight-transfer group."""
    device: str | None
    """Where it generates, as it reports it ("cuda:0", "cpu"); None when it does not say."""
    adapters: bool = False
    """Whether it takes a LoRA policy's adapters as tensors (`grpoflow.transport.adapters`) and
    adds them to its base (grpoflow serve with the native engine, or vllm with --enable-lora)."""
    engine: str | None = None
    """The engine that generates (grpoflow serve's --engine); None when it does not say."""
    max_lora_rank: int | None = None
    """The largest adapter rank it takes; None: any."""
    adapter_directories: bool = False
    """It takes adapters as a PEFT directory it loads by path (vLLM's own server with runtime LoRA
    loading, `runtime_adapters`), not as tensors."""


def discover(client: ServerClient) -> list[ServerOffer]:
    """Every server's offer, in server order (each question asked of all servers at once)."""
    models = client.map(lambda url: served_model(client, url))
    infos = client.map(lambda url: server_info(client, url))
    methods = client.map(lambda url, info: reload_method(client, url, info), infos)
    lora_ranks = client.map(
        lambda url, info: None if (info or {}).get("grpoflow") else runtime_lora_rank(client, url, info),
        infos,
    )
    answers = zip(client.urls, models, infos, methods, lora_ranks)
    return [_offer(*answer) for answer in answers]


def _offer(url: str, model: str, info: dict | None, method: str | None, lora_rank: int | None) -> ServerOffer:
    """One server's offer, from its answers; `lora_rank` set: vLLM's own server, loading adapter
    directories at run time."""
    if lora_rank is not None:
        # no collective transfer, no device said; adapters up to its rank, as directories
        return ServerOffer(url, model, method, False, None, True, "vllm", lora_rank, adapter_directories=True)
    grpoflow = (info or {}).get("grpoflow") or {}
    return ServerOffer(
        url,
        model,
        method,
        collective="gloo" in grpoflow.get("weight_transfer", {}).get("backends", []),
        device=grpoflow.get("device"),
        adapters=grpoflow.get("adapter_updates") is True,
        engine=grpoflow.get("engine"),
        max_lora_rank=_integer(grpoflow.get("max_lora_rank")),
    )


def _integer(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def adapters_alone(offers: Sequence[ServerOffer], model: nn.Module | None = None) -> bool:
    """Whether a LoRA policy's adapters go alone to every server after the first sync: every
    server takes adapters and, given the policy `model` (its PEFT layers), every server takes its
    rank, and vLLM servers the adapters themselves (`adapter_obstacle`). When not, a LoRA policy
    sends the merged weights whole at every sync, as the log says."""
    lacking = [offer.url for offer in offers if not offer.adapters]
    layers = lora_layers(model) if model is not None else []
    reason = None
    if lacking:
        reason = (
            f"server(s) {', '.join(lacking)} take no LoRA adapters (grpoflow serve takes them with "
            f"--engine native, or --engine vllm --enable-lora; vLLM's own server with --enable-lora "
            f"and VLLM_ALLOW_RUNTIME_LORA_UPDATING=1, in dev mode)"
        )
    elif len({offer.adapter_directories for offer in offers}) > 1:
        reason = "some servers are grpoflow serve and some vLLM's own, which take adapters differently"
    elif layers:
        reason = _adapter_refusal(offers, model)
    if reason is not None:
        if layers:
            logger.info("the rollout servers get the merged weights whole at every sync: %s", reason)
        return False
    if layers:
        logger.info("the rollout servers get the LoRA adapters alone at every sync after the first")
    return True


def _adapter_refusal(offers: Sequence[ServerOffer], model: nn.Module) -> str | None:
    """Why the servers, which all take adapters, cannot take `model`'s, or None."""
    experts = expert_adapter_obstacle(model)
    if experts is not None:
        return experts
    rank = adapter_rank(model)
    small = [offer for offer in offers if offer.max_lora_rank is not None and rank > offer.max_lora_rank]
    if small:
        return (
            f"the adapters' rank {rank} is above the --max-lora-rank of server(s) "
            f"{', '.join(f'{offer.url} ({offer.max_lora_rank})' for offer in small)}"
        )
    if any(offer.engine == "vllm" for offer in offers):
        return adapter_obstacle(model)
    return None


def served_model(client: ServerClient, url: str) -> str:
    models = client.request("GET", url, "/v1/models")["data"]
    if not models:
        raise ServerError(f"vLLM server {url} serves no model")
    return models[0]["id"]


def server_info(client: ServerClient, url: str) -> dict | None:
    """The server's /server_info, None when it has none."""
    try:
        return client.request("GET", url, "/server_info", params={"config_format": "json"})
    except ServerError:
        return None  # /server_info and /collective_rpc exist only with VLLM_SERVER_DEV_MODE=1


def reload_method(client: ServerClient, url: str, info: dict | None) -> str | None:
    """The worker method this server reloads weights with (None without dev mode); warns when
    its log-probs are taken before temperature or it lacks grpoflow's worker extension."""
    if info is None:
        return None
    mode = info.get("vllm_config", {}).get("model_config", {}).get("logprobs_mode")
    if mode != LOGPROBS_MODE:
        warnings.warn(
            f"vLLM server {url} reports logprobs_mode={mode!r}: its log-probs differ from the "
            f"trainer's when temperature != 1; start it with --logprobs-mode {LOGPROBS_MODE}",
            stacklevel=3,
        )
    try:
        client.request("POST", url, "/collective_rpc", json={"method": READY_METHOD})
        return RELOAD_METHOD
    except ServerError:
        warnings.warn(
            f"vLLM server {url} lacks grpoflow's worker extension: weights are reloaded with vLLM's "
            f"reload_weights, which on CPU servers leaves a tied LM head stale; start it with "
            f"--worker-extension-cls grpoflow.engines.vllm.WeightSyncExtension",
            stacklevel=3,
        )
        return VLLM_RELOAD_METHOD


def choose_transfer(choice: str, offers: Sequence[ServerOffer], *, exclusive_servers: bool) -> str:
    """collective or checkpoint, from the choice and what every server offers. `exclusive_servers`:
    every server has this trainer alone, so collective is open under torchrun too."""
    several_trainers = launched_world_size() > 1 and not exclusive_servers
    if choice == "collective":
        lacking = [offer.url for offer in offers if not offer.collective]
        if lacking:
            raise ValueError(
                f"vllm_weight_transfer=collective: server(s) {', '.join(lacking)} offer no collective "
                f"weight transfer (grpoflow serve does; vLLM's own server does not): use checkpoint or auto"
            )
        if several_trainers:
            raise ValueError(
                "vllm_weight_transfer=collective works from a single trainer process; under torchrun "
                "use checkpoint or auto"
            )
        return "collective"
    if choice == "auto" and all(offer.collective for offer in offers) and not several_trainers:
        return "collective"
    return "checkpoint"
