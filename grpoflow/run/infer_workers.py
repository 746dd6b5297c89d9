"""Rollout GPUs beside the training ones: `num_infer_workers` rollout servers that a run starts,
trains against in server mode, and stops.

ms-swift's layout: NPROC_PER_NODE training processes per node, plus `num_infer_workers` GPUs per
node that only generate. Here each of them runs `grpoflow serve` (the native engine) in a process
of its own that sees only its GPU; the training processes of a node split the node's servers
evenly (local rank r drives servers r*k .. r*k + k - 1), so every server has exactly one trainer
and weights travel over the collective transport. With `async_generate` the servers generate the
next batch while the trainer updates.
"""

from __future__ import annotations

import atexit
import logging
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from grpoflow.distributed import DistributedContext
    from grpoflow.run.config import GRPOConfig

logger = logging.getLogger("grpoflow")


def worker_gpus(
    num_infer_workers: int, local_rank: int, local_world_size: int, num_gpus: int | None
) -> list[int | None]:
    """The GPU index of each server this training process starts (None for a CPU server).

    Training processes use GPUs 0 .. local_world_size - 1 of the node; the servers take the GPUs
    after them. `num_gpus` is the node's GPU count, None on a machine without GPUs.
    """
    if num_infer_workers % local_world_size:
        raise ValueError(
            f"num_infer_workers={num_infer_workers} does not split evenly over the {local_world_size} "
            f"training processes of a node: use a multiple of {local_world_size}"
        )
    per_rank = num_infer_workers // local_world_size
    first = local_rank * per_rank
    if num_gpus is None:
        return [None] * per_rank
    if local_world_size + num_infer_workers > num_gpus:
        raise ValueError(
            f"{local_world_size} training process(es) and num_infer_workers={num_infer_workers} need "
            f"{local_world_size + num_infer_workers} GPUs, but this node has {num_gpus}: lower "
            f"num_infer_workers or NPROC_PER_NODE"
        )
    return [local_world_size + first + index for index in range(per_rank)]


def free_port() -> int:
    """A TCP port free on this machine now (for a server or a rendezvous)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class RolloutServers:
    """`grpoflow serve` processes on this machine, one per entry of `gpus`, each seeing only its
    GPU (None: a CPU server); `close()` stops them (also at interpreter exit, and when used as a
    context manager)."""

    def __init__(
        self, serve_flags: Sequence[str], gpus: Sequence[int | None], log_dir: str | Path | None = None
    ):
        """Start one server per entry of `gpus` with `grpoflow serve FLAGS`; returns at once
        (`wait_until_healthy`, or the engine, waits for /health)."""
        self.log_dir = Path(log_dir or tempfile.mkdtemp(prefix="grpoflow-servers-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.urls: list[str] = []
        self.log_paths: list[Path] = []
        self.processes: list[subprocess.Popen] = []
        root = str(Path(__file__).resolve().parents[1])
        for gpu in gpus:
            port = free_port()
            env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
            for name in (
                "RANK",
                "WORLD_SIZE",
                "LOCAL_RANK",
                "LOCAL_WORLD_SIZE",
                "MASTER_ADDR",
                "MASTER_PORT",
            ):
                env.pop(name, None)  # a server is no rank of the training job
            device = "cpu" if gpu is None else "cuda"
            if gpu is not None:
                env["CUDA_VISIBLE_DEVICES"] = str(gpu)
            command = [sys.executable, "-m", "grpoflow.cli", "serve", *serve_flags, "--device", device]
            command += ["--host", "127.0.0.1", "--port", str(port)]
            log_path = self.log_dir / f"server-{port}.log"
            with open(log_path, "w") as log:
                self.processes.append(
                    subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
                )
            self.urls.append(f"http://127.0.0.1:{port}")
            self.log_paths.append(log_path)
            where = device if gpu is None else f"GPU {gpu}"
            logger.info("rollout server on %s at %s (log %s)", where, self.urls[-1], log_path)
        atexit.register(self.close)

    def __enter__(self) -> RolloutServers:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def log_tail(self, index: int, size: int = 3000) -> str:
        path = self.log_paths[index]
        return path.read_text()[-size:] if path.exists() else ""

    def check_alive(self) -> None:
        """Raise naming the server and its log when one has exited."""
        for index, (url, process) in enumerate(zip(self.urls, self.processes)):
            if process.poll() is not None:
                raise RuntimeError(
                    f"rollout server {url} exited with code {process.returncode}:\n{self.log_tail(index)}"
                )

    def wait_until_healthy(self, timeout: float) -> None:
        """Poll every server's /health until all answer 200; raise with the log of one that
        exited or is still down after `timeout` seconds."""
        import httpx

        deadline = time.monotonic() + timeout
        pending = dict(enumerate(self.urls))
        while pending:
            for index, url in list(pending.items()):
                try:
                    if httpx.get(url + "/health", timeout=2).status_code == 200:
                        del pending[index]
                except httpx.HTTPError:
                    pass
            self.check_alive()
            if pending and time.monotonic() > deadline:
                index = next(iter(pending))
                raise RuntimeError(
                    f"rollout server {pending[index]} not healthy after {timeout:.0f}s:\n{self.log_tail(index)}"
                )
            if pending:
                time.sleep(0.2)

    def close(self) -> None:
        """Stop every server (terminate, then kill after 30 s)."""
        for process in self.processes:
            if process.poll() is None:
                process.terminate()
        for process in self.processes:
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        atexit.unregister(self.close)


def start_for_run(
    config: GRPOConfig, distributed: DistributedContext, dtype: torch.dtype
) -> RolloutServers | None:
    """The run's `num_infer_workers` rollout servers for this training process, or None: each
    serves the run's model with the run's seed, context and a decode batch that holds a step."""
    count = config.generation.num_infer_workers
    if not count:
        return None
    policy = config.policy
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    on_gpu = distributed.device.type == "cuda"
    gpus = worker_gpus(
        count, distributed.local_rank, local_world_size, torch.cuda.device_count() if on_gpu else None
    )
    rows = max(config.generation.engine.max_num_seqs, config.generation_batch_size)
    flags = ["--model", policy.model, "--dtype", str(dtype).removeprefix("torch."), "--seed"]
    flags += [
        str(config.training.seed),
        "--max-model-len",
        str(config.max_model_len),
        "--max-num-seqs",
        str(rows),
    ]
    flags += ["--trust-remote-code"] if policy.trust_remote_code else []
    return RolloutServers(flags, gpus, Path(config.training.output_dir) / "infer_workers")
