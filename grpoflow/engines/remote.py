"""Rollouts on one or several vLLM OpenAI-compatible servers, driven over HTTP.

Start each server yourself, e.g.

    VLLM_SERVER_DEV_MODE=1 python -m vllm.entrypoints.openai.api_server --model DIR \\
        --logprobs-mode processed_logprobs \\
        --worker-extension-cls grpoflow.engines.vllm.WeightSyncExtension

`generate` splits the prompts across the servers and sends one `/v1/completions` request to
each at once, with token-id prompts and `return_token_ids`, so no text is re-tokenised.
`--logprobs-mode processed_logprobs` makes the servers report log_softmax(logits / temperature)
of each sampled token, as the trainer computes it (vLLM's default reports it before temperature).

Weight updates (`weight_transfer`): `collective` broadcasts the weights in packed buckets over a
process group of the trainer and every server (NCCL between GPUs, gloo otherwise; grpoflow.transport),
which `grpoflow serve` offers; `checkpoint` works with any vLLM server; `auto` takes collective
when every server offers it and the trainer is a single process.

The checkpoint transport: vLLM's HTTP weight-transfer endpoints (`/init_weight_transfer_engine`,
`/update_weights`, ...) need an NCCL or CUDA-IPC backend, so they do not run on CPUs. This
engine uses a transport that works on any device instead: it writes the weights as safetensors
to a directory the servers can read (atomically: a finished directory is renamed into place),
then asks each server to reload them in place through `/collective_rpc`, which vLLM exposes with
`VLLM_SERVER_DEV_MODE=1`: method `grpoflow_reload_weights` of grpoflow's worker extension (it also
refreshes a CPU server's packed copy of a tied LM head), else vLLM's own `reload_weights`. Set
`GRPOFLOW_WEIGHT_SYNC_DIR` to a shared filesystem when the servers run on other machines.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
import warnings
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from grpoflow.engines.base import Completion, EngineOptions, EngineStats, SamplingParams
from grpoflow.engines.vllm import (
    DEFAULT_BUCKET_BYTES,
    LOGPROBS_MODE,
    finish_reason,
    sampling_fields,
    truncates_distribution,
    weight_buckets,
)
from grpoflow.options import require
from grpoflow.transport import WEIGHT_TRANSFERS, WeightSyncError
from grpoflow.transport.collective_sender import CollectiveSender

logger = logging.getLogger("grpoflow.engines.remote")

SYNC_DIR_ENV = "GRPOFLOW_WEIGHT_SYNC_DIR"
"""Environment variable naming the directory weight checkpoints are written to for the servers."""


class ServerError(RuntimeError):
    """A rollout server failed or answered badly; the message names the server."""


def server_urls(base_url: str | None, host: str | None, port: int) -> list[str]:
    """The servers' base URLs: `base_url` split on commas, else http://host:port."""
    if base_url:
        urls = [url.strip().rstrip("/") for url in base_url.split(",") if url.strip()]
        if not urls:
            raise ValueError(f"vllm_server_base_url={base_url!r} names no server")
        return [url if "://" in url else f"http://{url}" for url in urls]
    return [f"http://{host or '127.0.0.1'}:{port}"]


def split_evenly(count: int, parts: int) -> list[range]:
    """`parts` contiguous ranges covering range(count), sizes differing by at most one."""
    base, extra = divmod(count, parts)
    bounds = [0]
    for index in range(parts):
        bounds.append(bounds[-1] + base + (index < extra))
    return [range(bounds[i], bounds[i + 1]) for i in range(parts)]


class RemoteEngine:
    """Generates on vLLM servers over HTTP and pushes weights to them through a checkpoint."""

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
    ) -> None:
        """`exclusive_servers`: every server has this trainer alone (servers the run started), so
        the collective transport is open to it under torchrun too."""
        import httpx

        if not urls:
            raise ValueError("RemoteEngine needs at least one server URL")
        if weight_transfer not in WEIGHT_TRANSFERS:
            raise ValueError(f"weight_transfer {weight_transfer!r}; known: {', '.join(WEIGHT_TRANSFERS)}")
        self.urls = list(urls)
        self.exclusive_servers = exclusive_servers
        self.request_timeout, self.weight_sync_timeout = request_timeout, weight_sync_timeout
        self.bucket_bytes = bucket_bytes
        self._own_sync_dir = sync_dir is None and not os.environ.get(SYNC_DIR_ENV)
        directory = sync_dir or os.environ.get(SYNC_DIR_ENV) or tempfile.mkdtemp(prefix="grpoflow-weights-")
        self.sync_dir = Path(directory).resolve()
        self.sync_dir.mkdir(parents=True, exist_ok=True)
        self._client = httpx.Client(timeout=httpx.Timeout(request_timeout, connect=10.0))
        self._pool = ThreadPoolExecutor(max_workers=len(self.urls))
        self.policy_version = 0
        self.stats = EngineStats()
        self._warned: set[str] = set()
        self._current: Path | None = None
        self.wait_until_ready(startup_timeout)
        self.model_names = self._map(self._model_name)
        infos = self._map(self._server_info)
        self.reload_methods = self._map(self._check_server, infos)
        self.weight_transfer = self._choose_transfer(weight_transfer, infos)
        self._sender = (
            CollectiveSender(
                self.urls,
                [info["grpoflow"]["device"] for info in infos],
                self._request,
                bucket_bytes=bucket_bytes,
                timeout=weight_sync_timeout,
                init_timeout=startup_timeout,
            )
            if self.weight_transfer == "collective"
            else None
        )

    # -- HTTP ---------------------------------------------------------------------------------

    def _request(self, method: str, url: str, path: str, *, timeout: float | None = None, **kwargs):
        import httpx

        timeout = timeout or self.request_timeout
        try:
            response = self._client.request(method, url + path, timeout=timeout, **kwargs)
        except httpx.TimeoutException as error:
            raise ServerError(f"vLLM server {url}: {method} {path} timed out after {timeout}s") from error
        except httpx.HTTPError as error:
            raise ServerError(
                f"vLLM server {url}: {method} {path} failed ({error}); is the server running there?"
            ) from error
        if response.status_code != 200:
            raise ServerError(
                f"vLLM server {url} answered {method} {path} with HTTP {response.status_code}: "
                f"{response.text[:1000]}"
            )
        return response.json() if response.content else None

    def _map(self, function: Callable, *arguments: Sequence) -> list:
        """`function(url, *per-server arguments)` on every server at once, in server order."""
        per_server = zip(self.urls, *arguments) if arguments else ((url,) for url in self.urls)
        return list(self._pool.map(lambda args: function(*args), per_server))

    def wait_until_ready(self, timeout: float) -> None:
        """Poll every server's /health until all answer 200, for at most `timeout` seconds."""
        deadline = time.monotonic() + timeout
        pending = list(self.urls)
        while pending:
            for url in list(pending):
                try:
                    if self._client.get(url + "/health", timeout=5.0).status_code == 200:
                        pending.remove(url)
                except Exception:  # not up yet: connection refused, reset, ...
                    pass
            if pending and time.monotonic() > deadline:
                raise ServerError(
                    f"vLLM server(s) {', '.join(pending)} not healthy after {timeout:.0f}s: start them "
                    f"(python -m vllm.entrypoints.openai.api_server --model ...) or raise vllm_server_timeout"
                )
            if pending:
                time.sleep(1.0)

    def _model_name(self, url: str) -> str:
        models = self._request("GET", url, "/v1/models")["data"]
        if not models:
            raise ServerError(f"vLLM server {url} serves no model")
        return models[0]["id"]

    def _server_info(self, url: str) -> dict | None:
        try:
            return self._request("GET", url, "/server_info", params={"config_format": "json"})
        except ServerError:
            return None  # /server_info and /collective_rpc exist only with VLLM_SERVER_DEV_MODE=1

    def _check_server(self, url: str, info: dict | None) -> str | None:
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
            self._request("POST", url, "/collective_rpc", json={"method": "grpoflow_weight_sync_ready"})
            return "grpoflow_reload_weights"
        except ServerError:
            warnings.warn(
                f"vLLM server {url} lacks grpoflow's worker extension: weights are reloaded with vLLM's "
                f"reload_weights, which on CPU servers leaves a tied LM head stale; start it with "
                f"--worker-extension-cls grpoflow.engines.vllm.WeightSyncExtension",
                stacklevel=3,
            )
            return "reload_weights"

    def _choose_transfer(self, choice: str, infos: list[dict | None]) -> str:
        """collective or checkpoint, from the choice and what every server offers."""
        offered = [
            "gloo" in ((info or {}).get("grpoflow") or {}).get("weight_transfer", {}).get("backends", [])
            for info in infos
        ]
        several_trainers = int(os.environ.get("WORLD_SIZE", "1")) > 1 and not self.exclusive_servers
        if choice == "collective":
            lacking = [url for url, ok in zip(self.urls, offered) if not ok]
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
        if choice == "auto" and all(offered) and not several_trainers:
            return "collective"
        return "checkpoint"

    # -- generation ---------------------------------------------------------------------------

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[list[Completion]]:
        for index, prompt in enumerate(prompts):
            if len(prompt) == 0:
                raise ValueError(f"prompt {index} is empty: give at least one token")
        if truncates_distribution(params) and "truncated" not in self._warned:
            self._warned.add("truncated")
            warnings.warn(
                "vLLM reports log-probs under the truncated distribution it samples from "
                "(top_p/top_k/min_p/repetition_penalty); the trainer's are untruncated",
                stacklevel=2,
            )
        start = time.perf_counter()
        chunks = [[list(prompts[i]) for i in part] for part in split_evenly(len(prompts), len(self.urls))]
        busy = [(url, name, chunk) for url, name, chunk in zip(self.urls, self.model_names, chunks) if chunk]
        answers = list(self._pool.map(lambda job: self._complete(*job, params), busy))
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
        answer = self._request("POST", url, "/v1/completions", json=body)
        choices = sorted(answer["choices"], key=lambda choice: choice["index"])
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
        if token_ids is None or logprobs is None or len(logprobs) != len(token_ids):
            raise ServerError(
                f"vLLM server {url} returned no token ids or log-probs for a completion: it needs "
                f"vLLM >= 0.10 (return_token_ids)"
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
        `sync_dir/policy-v{version}` and have every server reload them (checkpoint)."""
        if self._sender is not None:
            self._sender.send(weights, version)
            self.policy_version = version
            return
        missing = [url for url, method in zip(self.urls, self.reload_methods) if method is None]
        if missing:
            raise ValueError(
                f"vLLM server(s) {', '.join(missing)} do not expose /collective_rpc, which weight updates "
                f"use: restart them with VLLM_SERVER_DEV_MODE=1"
            )
        directory = self._write_checkpoint(weights, version)
        self._map(lambda url, method: self._reload(url, method, directory, version), self.reload_methods)
        previous, self._current = self._current, directory
        if previous is not None and previous != directory:
            shutil.rmtree(previous, ignore_errors=True)
        self.policy_version = version

    def _write_checkpoint(self, weights: Iterable[tuple[str, torch.Tensor]], version: int) -> Path:
        from safetensors.torch import save_file

        final = self.sync_dir / f"policy-v{version}"
        staging = self.sync_dir / f".policy-v{version}.partial-{os.getpid()}"
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        name = None
        try:
            for index, bucket in enumerate(weight_buckets(weights, self.bucket_bytes)):
                tensors = {}
                for name, tensor in bucket:
                    tensors[name] = tensor.to("cpu").contiguous()
                name = f"{bucket[0][0]} .. {bucket[-1][0]} (shard {index + 1})"
                save_file(tensors, str(staging / f"model-{index + 1:05d}.safetensors"))
        except Exception as error:
            shutil.rmtree(staging, ignore_errors=True)
            raise WeightSyncError(
                f"weight update to version {version}: writing the checkpoint to {staging} failed at "
                f"parameter {name!r}: {error}"
            ) from error
        shutil.rmtree(final, ignore_errors=True)
        os.replace(staging, final)  # servers only ever see complete directories
        return final

    def _reload(self, url: str, method: str, directory: Path, version: int) -> None:
        timeout = self.weight_sync_timeout
        steps = [
            ("pause", "/pause", dict(params={"mode": "wait"})),
            (
                "reload_weights",
                "/collective_rpc",
                dict(
                    json={
                        "method": method,
                        "kwargs": {"weights_path": str(directory)},
                        "timeout": timeout,
                    }
                ),
            ),
            ("reset_prefix_cache", "/reset_prefix_cache", {}),
            ("update_weight_version", "/update_weight_version", dict(json={"new_version": str(version)})),
            ("resume", "/resume", {}),
        ]
        for step, path, kwargs in steps:
            try:
                self._request("POST", url, path, timeout=timeout, **kwargs)
            except ServerError as error:
                if step != "resume":
                    self._try_resume(url)
                raise WeightSyncError(
                    f"weight update to version {version} on vLLM server {url} failed at step {step!r} "
                    f"(weights in {directory}): {error}"
                ) from error

    def _try_resume(self, url: str) -> None:
        try:
            self._request("POST", url, "/resume", timeout=30.0)
        except ServerError as error:
            logger.warning("could not resume %s after a failed weight update: %s", url, error)

    def sleep(self, level: int = 1) -> None:
        """The servers keep their own memory: nothing to release in the training process."""
        return None

    def wake_up(self) -> None:
        return None

    def close(self) -> None:
        if self._sender is not None:
            self._sender.close()
        self._client.close()
        self._pool.shutdown(wait=False)
        if self._own_sync_dir:
            shutil.rmtree(self.sync_dir, ignore_errors=True)


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
    vllm_weight_transfer: Literal["auto", "collective", "checkpoint"] = "auto"
    """How weights reach rollout servers: collective (packed broadcasts over an NCCL or gloo group;
    `grpoflow serve` only), checkpoint (a safetensors directory each server reloads), auto
    (collective when every server offers it)."""

    def __post_init__(self) -> None:
        require(0 < self.vllm_server_port < 65536, "vllm_server_port", "in 1..65535", self.vllm_server_port)
        require(
            self.vllm_server_timeout > 0, "vllm_server_timeout", "> 0 (seconds)", self.vllm_server_timeout
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
    )
