"""Atropos's trajectory API (`run-api`, atroposlib's command) in a process of its own, and an
Atropos environment process, for the tests that need them."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

from grpoflow.run.infer_workers import free_port
from helpers.support import stop_process

ENV_SCRIPT = Path(__file__).resolve().parent / "atropos_env.py"


@contextlib.contextmanager
def trajectory_api(log_dir: Path) -> Iterator[str]:
    """atroposlib's `run-api` in a process of its own on a free port; yields its URL once it answers."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = [str(Path(sys.executable).parent / "run-api"), "--host", "127.0.0.1", "--port", str(port)]
    with open(log_dir / "api.log", "w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_until_answering(f"{url}/status", process, timeout=30)
        yield url
    finally:
        stop_process(process)


def wait_until_answering(url: str, process: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            httpx.get(url, timeout=2).raise_for_status()
            return
        except httpx.TransportError:
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{url} did not come up (exit code {process.poll()})") from None
            time.sleep(0.05)


@contextlib.contextmanager
def letter_environment(
    api: str, server_url: str, tokenizer_dir: Path, log: Path
) -> Iterator[subprocess.Popen]:
    """The letter environment (atropos_env.py) posting to `api` and sampling from the server at
    `server_url`, in a process of its own."""
    command = [
        sys.executable,
        str(ENV_SCRIPT),
        "serve",
        *("--env.rollout_server_url", api, "--env.tokenizer_name", str(tokenizer_dir)),
        *("--openai.base_url", f"{server_url}/v1", "--openai.tokenizer_name", str(tokenizer_dir)),
    ]
    with open(log, "w") as output:
        process = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT)
    try:
        yield process
    finally:
        stop_process(process)
