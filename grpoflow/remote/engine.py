"""Rollouts on one or several vLLM OpenAI-compatible servers, driven over HTTP.

Start each server yourself, e.g.

    VLLM_SERVER_DEV_MODE=1 python -m vllm.entrypoints.openai.api_server --model DIR \\
        --logprobs-mode processed_logprobs \\
        --worker-extension-cls grpoflow.engines.vllm.WeightSyncExtension

`generate` splits the prompts across the servers and sends one `/v1/completions` request to
each at once, with token-id prompts and `return_token_ids`, so no text is re-tokenised.
`--logprobs-mode processed_logprobs` makes the servers report log_softmax(logits / temperature)
of each sampled token, as the trainer computes it (vLLM's default reports it before temperature).

The engine is assembled from `grpoflow.transport.server_client.ServerClient` (HTTP, the /health wait, the thread per
server), `grpoflow.remote.capabilities` (what each server offers, and the weight transfer chosen from it)
and a sender of `grpoflow.transport`. Weight updates (`weight_transfer`): `collective` broadcasts
the weights in packed buckets over a process group of the trainer and every server (NCCL between
GPUs, gloo otherwise), which `grpoflow serve` offers; `checkpoint` writes safetensors that every
server reloads through `/collective_rpc` (any vLLM server with `VLLM_SERVER_DEV_MODE=1`, on any
device; set `GRPOFLOW_WEIGHT_SYNC_DIR` to a shared filesystem when the servers run on other
machines); `auto` takes collective when every server offers it and the trainer is a single process.
A LoRA policy's adapters go alone after the first sync to servers that take them: as tensors to
`grpoflow serve`, as a directory loaded by path to vLLM's own server with runtime LoRA loading
(`grpoflow.remote.runtime_adapters`).
"""

from __future__ import annotations

import logging
import math
import time
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from grpoflow.engines.base import Completion, EngineCapabilities, EngineOptions, EngineStats, SamplingParams
from grpoflow.engines.vllm import finish_reason, penalises_repetition, sampling_fields
from grpoflow.options import require
from grpoflow.remote.capabilities import adapters_alone, choose_transfer, discover
from grpoflow.remote.runtime_adapters import ServerAdapters
from grpoflow.transport import WEIGHT_TRANSFERS, ServerError
from grpoflow.transport.adapters import split_adapters
from grpoflow.transport.checkpoint_sender import CheckpointSender
from grpoflow.transport.collective import DEFAULT_BUCKET_BYTES
from grpoflow.transport.collective_sender import CollectiveSender
from grpoflow.transport.server_client import ServerClient, server_urls

logger = logging.getLogger("grpoflow.remote")


def split_evenly(count: int, parts: int) -> list[range]:
    """`parts` contiguous ranges covering range(count), sizes differing by at most one."""
    base, extra = divmod(count, parts)
    bounds = [0]
    for index in range(parts):
        bounds.append(bounds[-1] + base + (index < extra))
    return [range(bounds[i], bounds[i + 1]) for i in range(parts)]


class RemoteEngine:
    """Generates on vLLM servers over HTTP and pushes weights to them through `transport`."""

    capabilities: EngineCapabilities
    shares_policy_weights = False

    def __init__(
        self,
        urls: Sequence[str],
        *,
        startup_timeout: float = 240.0,
        request_timeout: float = 3600.0,
        weight_sync_timeout: float = 600.0,
        sync_dir: str | Path | None = None,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        weight_transfer: str = "auto",
        exclusive_servers: bool = False,
        api_key: str | None = None,
        vocab_size: int | None = None,
        generation_retries: int = 2,
        model: torch.nn.Module | None = None,
    ) -> None:
        """`sync_dir`: where the checkpoint transport writes (default: GRPOFLOW_WEIGHT_SYNC_DIR, else
        a temporary directory). `exclusive_servers`: every server has this trainer alone (servers
        the run started), so the collective transport is open to it under torchrun too. `api_key`:
        sent to every server (default: VLLM_API_KEY). `vocab_size`: completions holding token ids
        outside it are refused. `generation_retries`: further tries of a generation request that
        failed before an answer (sampling is idempotent: nothing is kept from a failed try). `model`:
        the policy as it generates (its PEFT layers, if LoRA): its adapters go alone after the first
        sync only when every server takes their rank and layers (`adapters_alone`)."""
        if not urls:
            raise ValueError("RemoteEngine needs at least one server URL")
        if weight_transfer not in WEIGHT_TRANSFERS:
            raise ValueError(f"weight_transfer {weight_transfer!r}; known: {', '.join(WEIGHT_TRANSFERS)}")
        self.urls = list(urls)
        self.client = ServerClient(self.urls, request_timeout=request_timeout, api_key=api_key)
        self.vocab_size, self.generation_retries = vocab_size, generation_retries
        self.policy_version = 0
        self.stats = EngineStats()
        self._warned: set[str] = set()
        self.client.wait_until_healthy(startup_timeout)
        offers = discover(self.client)
        self.reload_methods = [offer.reload_method for offer in offers]
        self.capabilities = EngineCapabilities(
            name="vllm_server",
            accepts_adapters=adapters_alone(offers, model),
            servers=tuple((offer.url, offer.model) for offer in offers),
        )
        self.holds_base = False  # until the first sync: then a LoRA policy sends its adapters alone
        self.weight_transfer = choose_transfer(weight_transfer, offers, exclusive_servers=exclusive_servers)
        self.server_adapters: ServerAdapters | None = None
        self.transport: CollectiveSender | CheckpointSender
        if self.weight_transfer == "collective":
            self.transport = CollectiveSender(
                self.urls,
                [offer.device for offer in offers],
                self.client.request,
                bucket_bytes=bucket_bytes,
                timeout=weight_sync_timeout,
                init_timeout=startup_timeout,
            )
        else:
            self.transport = CheckpointSender(
                self.urls,
                self.reload_methods,
                self.client.request,
                directory=sync_dir,
                bucket_bytes=bucket_bytes,
                timeout=weight_sync_timeout,
            )
            if self.capabilities.accepts_adapters and all(offer.adapter_directories for offer in offers):
                self.server_adapters = ServerAdapters(
                    self.client, self.transport.directory, weight_sync_timeout
                )

    # -- generation ---------------------------------------------------------------------------

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[list[Completion]]:
        for index, prompt in enumerate(prompts):
            if len(prompt) == 0:
                raise ValueError(f"prompt {index} is empty: give at least one token")
        if penalises_repetition(params) and "penalised" not in self._warned:
            self._warned.add("penalised")
            warnings.warn(
                "the server reports log-probs with the repetition penalty applied; the trainer's "
                "are unpenalised, so their gap includes the penalty",
                stacklevel=2,
            )
        start = time.perf_counter()
        chunks = [[list(prompts[i]) for i in part] for part in split_evenly(len(prompts), len(self.urls))]
        adapter = self.server_adapters.name if self.server_adapters is not None else None
        names = [adapter] * len(self.urls) if adapter else [name for _, name in self.capabilities.servers]
        busy = [(url, name, chunk) for url, name, chunk in zip(self.urls, names, chunks) if chunk]
        answers = self.client.starmap(lambda *job: self._complete(*job, params), busy)
        groups = [group for answer in answers for group in answer]
        self.stats = EngineStats(
            num_prompt_tokens=sum(map(len, prompts)) * params.n,
            num_generated_tokens=sum(len(c.token_ids) for group in groups for c in group),
            seconds=time.perf_counter() - start,
            extra={"num_servers_used": float(len(busy))},
        )
        return groups

    def _complete(self, url: str, model: str, prompts: list[list[int]], params: SamplingParams):
        body = {
            "model": model,
            "prompt": prompts,
            **sampling_fields(params),
            "return_token_ids": True,
            # Token strings would be decoded one token at a time on the server; ids are enough.
            "return_tokens_as_token_ids": True,
            "skip_special_tokens": True,
        }
        answer = self.client.request(
            "POST", url, "/v1/completions", json=body, retries=self.generation_retries
        )
        choices = answer.get("choices") if isinstance(answer, dict) else None
        if not isinstance(choices, list) or not all(
            isinstance(choice, dict) and isinstance(choice.get("index"), int) for choice in choices
        ):
            raise ServerError(
                f"vLLM server {url} answered POST /v1/completions without a list of indexed choices: "
                f"{str(answer)[:200]}"
            )
        choices = sorted(choices, key=lambda choice: choice["index"])
        if len(choices) != len(prompts) * params.n:
            raise ServerError(
                f"vLLM server {url} returned {len(choices)} completions for {len(prompts)} prompts "
                f"x n={params.n}"
            )
        completions = [self._completion(url, choice) for choice in choices]
        return [completions[i : i + params.n] for i in range(0, len(completions), params.n)]

    def _completion(self, url: str, choice: dict) -> Completion:
        token_ids = choice.get("token_ids")
        logprobs = (choice.get("logprobs") or {}).get("token_logprobs")
        if (
            not isinstance(token_ids, list)
            or not isinstance(logprobs, list)
            or len(logprobs) != len(token_ids)
        ):
            raise ServerError(
                f"vLLM server {url} returned no token ids or log-probs for a completion: it needs "
                f"vLLM >= 0.10 (return_token_ids)"
            )
        vocab = self.vocab_size
        if not all(
            isinstance(token, int) and token >= 0 and (vocab is None or token < vocab) for token in token_ids
        ):
            raise ServerError(
                f"vLLM server {url} returned token ids outside the policy's vocabulary [0, {vocab}) in "
                f"completion {choice['index']}: is it serving the same model?"
            )
        if not all(
            isinstance(value, int | float) and math.isfinite(value) and value <= 0 for value in logprobs
        ):
            raise ServerError(
                f"vLLM server {url} returned log-probs that are not finite numbers <= 0 in completion "
                f"{choice['index']}: its weights may hold NaN or infinite values"
            )
        return Completion(
            token_ids=list(token_ids),
            logprobs=[float(value) for value in logprobs],
            finish_reason=finish_reason(choice.get("finish_reason"), f"vLLM server {url}"),
            policy_version=self.policy_version,
            text=choice.get("text"),
        )

    # -- weights ------------------------------------------------------------------------------

    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Broadcast the weights to every server (collective), or write them to
        `sync_dir/policy-v{version}` and have every server reload them (checkpoint). Servers that
        take adapters (`capabilities.accepts_adapters`) may get a LoRA policy's adapters as tensors; the first
        update that arrives whole gives them the base (`holds_base`); vLLM's own servers get the
        adapters as a directory they load (`runtime_adapters`), the rest through the transport."""
        if self.server_adapters is not None:
            weights, adapters = split_adapters(weights)
            if weights:
                self.transport.send(weights, version)
            if adapters:
                self.server_adapters.load(adapters, version)
            else:
                self.server_adapters.clear()
        else:
            self.transport.send(weights, version)
        self.policy_version = version
        self.holds_base = True

    def sleep(self, level: int = 1) -> None:
        """The servers keep their own memory: nothing to release in the training process."""
        return None

    def wake_up(self) -> None:
        return None

    def reset_prefix_cache(self) -> None:
        """Each server keeps its own cache, dropped at every weight update."""

    def close(self) -> None:
        if self.server_adapters is not None:
            self.server_adapters.close()
        self.transport.close()
        self.client.close()


@dataclass(kw_only=True, slots=True)
class RemoteConfig:
    """The rollout servers a run generates on (`use_vllm: true`, `vllm_mode: server`)."""

    vllm_server_host: str | None = None
    """Host of the rollout server (server mode)."""
    vllm_server_port: int = 8000
    """Port of the rollout server."""
    vllm_server_base_url: str | None = None
    """Full URL of the rollout server; overrides host and port. Several, comma-separated, split
    prompts between them."""
    vllm_server_timeout: float = 240.0
    """Seconds to wait for the server to come up."""
    vllm_server_api_key: str | None = None
    """Key sent to the rollout servers as `Authorization: Bearer KEY` (their --api-key); unset: the
    VLLM_API_KEY environment variable, else none."""
    vllm_server_retries: int = 2
    """Further tries of a generation request that failed before the server answered (connection
    refused or reset, 502/503/504), with backoff, within vllm_server_request_timeout."""
    vllm_server_request_timeout: float = 3600.0
    """Seconds one generation request may take in all (a total deadline, not per read)."""
    vllm_weight_transfer: Literal["auto", "collective", "checkpoint"] = "auto"
    """How weights reach rollout servers: collective (packed broadcasts over an NCCL or gloo group;
    `grpoflow serve` only), checkpoint (a safetensors directory each server reloads), auto
    (collective when every server offers it)."""

    def __post_init__(self) -> None:
        require(0 < self.vllm_server_port < 65536, "vllm_server_port", "in 1..65535", self.vllm_server_port)
        require(
            self.vllm_server_timeout > 0, "vllm_server_timeout", "> 0 (seconds)", self.vllm_server_timeout
        )
        require(self.vllm_server_retries >= 0, "vllm_server_retries", ">= 0", self.vllm_server_retries)
        require(
            self.vllm_server_request_timeout > 0,
            "vllm_server_request_timeout",
            "> 0 (seconds)",
            self.vllm_server_request_timeout,
        )


def build(model: torch.nn.Module, tokenizer, options: EngineOptions) -> RemoteEngine:
    """Registry factory: a client of the servers named in the run's vLLM config."""
    config = options.remote or RemoteConfig()
    urls = server_urls(config.vllm_server_base_url, config.vllm_server_host, config.vllm_server_port)
    logger.info("generating on vLLM server(s) %s", ", ".join(urls))
    return RemoteEngine(
        urls,
        startup_timeout=config.vllm_server_timeout,
        weight_sync_timeout=max(config.vllm_server_timeout, 600.0),
        weight_transfer=config.vllm_weight_transfer,
        exclusive_servers=options.exclusive_servers,
        api_key=config.vllm_server_api_key,
        vocab_size=getattr(getattr(model, "config", None), "vocab_size", None),
        generation_retries=config.vllm_server_retries,
        request_timeout=config.vllm_server_request_timeout,
        model=model,
    )
