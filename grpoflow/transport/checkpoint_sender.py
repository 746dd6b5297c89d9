"""The trainer's side of the checkpoint transport: safetensors on a shared disk, reloaded by each server.

vLLM's HTTP weight-transfer endpoints need an NCCL or CUDA-IPC backend, so they do not run on CPUs;
this transport works on any device and with any vLLM server started with `VLLM_SERVER_DEV_MODE=1`.
`CheckpointSender.send(weights, version)`:
1. writes the weights as safetensors shards of at most `bucket_bytes` to
   `directory/policy-v{version}`, atomically: a finished directory is renamed into place, so a
   server never reads a partial one;
2. on every server at once: POST /pause, /collective_rpc with the reload method and the directory,
   /reset_prefix_cache, /update_weight_version, /resume; a failed step resumes the server and
   raises WeightSyncError naming the server, the version and the step;
3. removes the previous version's directory.

The reload method is `grpoflow_reload_weights` of grpoflow's vLLM worker extension (it also
refreshes a CPU server's packed copy of a tied LM head), else vLLM's own `reload_weights`. The
directory is `GRPOFLOW_WEIGHT_SYNC_DIR` when set (a shared filesystem when the servers run on other
machines), else a temporary one removed by `close`.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from grpoflow.transport import Request, ServerError, WeightSyncError

logger = logging.getLogger("grpoflow.transport")

SYNC_DIR_ENV = "GRPOFLOW_WEIGHT_SYNC_DIR"
"""Environment variable naming the directory weight checkpoints are written to for the servers."""
DEFAULT_BUCKET_BYTES = 512 * 2**20
"""Most bytes of weights in one shard written for a server."""
RELOAD_METHOD = "grpoflow_reload_weights"
"""The /collective_rpc method of grpoflow's vLLM worker extension that reloads a checkpoint."""
VLLM_RELOAD_METHOD = "reload_weights"
"""vLLM's own reload, for servers without grpoflow's worker extension."""
READY_METHOD = "grpoflow_weight_sync_ready"
"""The /collective_rpc method that answers when grpoflow's worker extension is installed."""


def weight_buckets(
    weights: Iterable[tuple[str, torch.Tensor]], max_bytes: int = DEFAULT_BUCKET_BYTES
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Consecutive lists of `(name, tensor)` of at most `max_bytes` each (a larger tensor alone)."""
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in weights:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > max_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor.detach()))
        size += nbytes
    if bucket:
        yield bucket


def write_checkpoint(
    weights: Iterable[tuple[str, torch.Tensor]],
    directory: Path,
    version: int,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
) -> Path:
    """Write `directory/policy-v{version}` (shards `model-00001.safetensors`, ...) through a staging
    directory renamed into place; WeightSyncError naming the parameter it stopped at."""
    from safetensors.torch import save_file

    final = directory / f"policy-v{version}"
    staging = directory / f".policy-v{version}.partial-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    name = None
    try:
        for index, bucket in enumerate(weight_buckets(weights, bucket_bytes)):
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


class CheckpointSender:
    """Sends weights to the servers at `urls` through checkpoints they reload with `reload_methods`
    (one per server; None for a server without /collective_rpc, which makes `send` refuse)."""

    def __init__(
        self,
        urls: Sequence[str],
        reload_methods: Sequence[str | None],
        request: Request,
        *,
        directory: str | Path | None = None,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        timeout: float = 600.0,
    ) -> None:
        self.urls, self.reload_methods, self.request = list(urls), list(reload_methods), request
        self.bucket_bytes, self.timeout = bucket_bytes, timeout
        self._own_directory = directory is None and not os.environ.get(SYNC_DIR_ENV)
        chosen = directory or os.environ.get(SYNC_DIR_ENV) or tempfile.mkdtemp(prefix="grpoflow-weights-")
        self.directory = Path(chosen).resolve()
        self.directory.mkdir(parents=True, exist_ok=True)
        self._current: Path | None = None
        self._pool = ThreadPoolExecutor(max_workers=len(self.urls))

    def send(self, weights: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Write the weights to `directory/policy-v{version}` and have every server reload them."""
        missing = [url for url, method in zip(self.urls, self.reload_methods) if method is None]
        if missing:
            raise ValueError(
                f"vLLM server(s) {', '.join(missing)} do not expose /collective_rpc, which weight updates "
                f"use: restart them with VLLM_SERVER_DEV_MODE=1"
            )
        checkpoint = write_checkpoint(weights, self.directory, version, self.bucket_bytes)
        jobs = zip(self.urls, self.reload_methods)
        list(self._pool.map(lambda job: self._reload(*job, checkpoint, version), jobs))
        previous, self._current = self._current, checkpoint
        if previous is not None and previous != checkpoint:
            shutil.rmtree(previous, ignore_errors=True)

    def _reload(self, url: str, method: str, checkpoint: Path, version: int) -> None:
        timeout = self.timeout
        steps = [
            ("pause", "/pause", dict(params={"mode": "wait"})),
            (
                "reload_weights",
                "/collective_rpc",
                dict(
                    json={
                        "method": method,
                        "kwargs": {"weights_path": str(checkpoint)},
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
                self.request("POST", url, path, timeout=timeout, **kwargs)
            except ServerError as error:
                if step != "resume":
                    self._try_resume(url)
                raise WeightSyncError(
                    f"weight update to version {version} on vLLM server {url} failed at step {step!r} "
                    f"(weights in {checkpoint}): {error}"
                ) from error

    def _try_resume(self, url: str) -> None:
        try:
            self.request("POST", url, "/resume", timeout=30.0)
        except ServerError as error:
            logger.warning("could not resume %s after a failed weight update: %s", url, error)

    def close(self) -> None:
        """Stop the worker threads; remove the directory when it is a temporary one of this sender."""
        self._pool.shutdown(wait=False)
        if self._own_directory:
            shutil.rmtree(self.directory, ignore_errors=True)
