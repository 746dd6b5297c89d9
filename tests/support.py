"""Helpers shared by the end-to-end tests: quick configs on the embedded default, reward plugins."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpoflow
from grpoflow.cli import DEFAULT_RECIPE
from grpoflow.config import GRPOConfig, load_config

QUICK = {
    "report_to": ["none"],
    "disable_tqdm": True,
    "max_steps": 4,
    "per_device_train_batch_size": 16,
    "save_steps": 1000,
}
"""A few small steps of the embedded default, no sinks but metrics.jsonl."""

HALF_ECHO_PLUGIN = (
    "from grpoflow.tasks.echo import echo_reward\n"
    "def half(completions, letter, **kwargs):\n"
    "    scores = echo_reward(completions, letter)\n"
    "    return [s + 1.0 if l in 'efgh' else 0.0 for s, l in zip(scores, letter)]\n"
)
"""A reward plugin (function `half`): prompts for letters a-d always score 0 (zero spread, which
dynamic sampling drops), e-h score 1 plus the echo reward."""


def recipe(directory: Path, **overrides) -> GRPOConfig:
    """The embedded default recipe, QUICK settings and `overrides`, writing to directory/run."""
    return load_config(DEFAULT_RECIPE, {"output_dir": str(directory / "run"), **QUICK, **overrides})


def write_plugin(directory: Path, text: str = HALF_ECHO_PLUGIN) -> Path:
    path = directory / "plugin.py"
    path.write_text(text)
    return path


@contextlib.contextmanager
def serve_in_subprocess(log_dir: Path, *flags: str, timeout: float = 120.0) -> Iterator[str]:
    """`grpoflow serve --model tiny --device cpu FLAGS` in a process of its own on a free port;
    yields its URL once /health answers (the log is log_dir/server.log)."""
    import httpx

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [sys.executable, "-m", "grpoflow.cli", "serve", "--model", "tiny", "--device", "cpu"]
    command += ["--host", "127.0.0.1", "--port", str(port), *flags]
    log_path = log_dir / "server.log"
    root = str(Path(grpoflow.__file__).resolve().parents[1])  # this checkout's grpoflow, not another
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"grpoflow serve did not come up:\n{log_path.read_text()[-3000:]}")
            time.sleep(0.2)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
