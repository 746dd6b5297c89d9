"""Helpers shared by the end-to-end tests: quick configs on the embedded default, reward plugins."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import torch
import yaml
from safetensors.torch import load_file

from grpoflow.cli import DEFAULT_RECIPE
from grpoflow.run import torchrun
from grpoflow.run.config import GRPOConfig, load_config
from grpoflow.run.infer_workers import RolloutServers, free_port  # noqa: F401 (tests import free_port from here)

QUICK = {
    "report_to": ["none"],
    "disable_tqdm": True,
    "max_steps": 4,
    "per_device_train_batch_size": 16,
    "save_steps": 1000,
    "html_report": False,
}
"""A few small steps of the embedded default, no sinks but metrics.jsonl (and no report)."""

VLLM_TINY_SHAPE = dict(
    hidden_size=128, num_attention_heads=2, num_key_value_heads=1, num_hidden_layers=2, intermediate_size=256
)
"""A tiny model vLLM's CPU attention takes (head_dim 64; it rejects the `tiny` preset's 16)."""

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
    yields its URL once /health answers (the log is in log_dir)."""
    with RolloutServers(["--model", "tiny", *flags], [None], log_dir) as servers:
        servers.wait_until_healthy(timeout)
        yield servers.urls[0]


@contextlib.contextmanager
def vllm_openai_server(model_dir: Path, log_dir: Path, *flags: str, **env: str) -> Iterator[str]:
    """vLLM's own OpenAI server on the CPU for `model_dir` (float32, eager, the trainer's log-prob
    mode, dev mode and grpoflow's worker extension) plus FLAGS and ENV, on a free port; yields its
    URL at once (the engine under test waits for /health). The log is log_dir/server.log."""
    port = free_port()
    environment = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", **env}
    environment.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    command = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model_dir), "--port", str(port), "--enforce-eager",
        "--dtype", "float32", "--logprobs-mode", "processed_logprobs",
        "--worker-extension-cls", "grpoflow.engines.vllm.WeightSyncExtension", *flags,
    ]  # fmt: skip
    with open(log_dir / "server.log", "w") as log:
        process = subprocess.Popen(command, env=environment, stdout=log, stderr=subprocess.STDOUT)
        try:
            yield f"http://127.0.0.1:{port}"
        finally:
            stop_process(process, timeout=30)


RUN = {
    "report_to": ["none"],
    "disable_tqdm": True,
    "max_steps": 4,
    "save_steps": 2,
    "per_device_train_batch_size": 16,
    "num_iterations": 2,
    "beta": 0.05,
    "log_completions": True,
    "html_report": False,
    "group_by_length": False,
}
"""A run small enough for two CPU processes: 4 steps of 2 prompts x 8 completions per rank. Its
micro-batches keep the batch's order (no `group_by_length`), so one process cutting the global
batch in two makes the micro-batches the two ranks make, and per-micro-batch metrics compare."""


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without torchrun's and the launch variables, plus `extra`."""
    dropped = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", *torchrun.LAUNCH_VARIABLES}
    env = {key: value for key, value in os.environ.items() if key not in dropped}
    return {**env, "OMP_NUM_THREADS": "1", **extra}


def recipe_values(output_dir, **overrides) -> dict:
    """The embedded default recipe with RUN and `overrides` on top."""
    default = yaml.safe_load(DEFAULT_RECIPE.read_text())
    return {**default, **RUN, "output_dir": str(output_dir), **overrides}


def write_config(tmp_path, name: str, **overrides) -> tuple:
    output_dir = tmp_path / name
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(recipe_values(output_dir, **overrides)))
    return path, output_dir


def grpoflow_train(config_path, env: dict[str, str], *, torchrun: bool = False, timeout: int = 240):
    command = [sys.executable, "-m", "grpoflow.cli", "train", "--config", str(config_path)]
    if torchrun:
        command[1:3] = ["-m", "torch.distributed.run", "--nproc_per_node", "2"]
        command[5:5] = ["--master_port", str(free_port()), "-m", "grpoflow.cli"]
    return subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    ), timeout


def finish(started) -> str:
    process, timeout = started
    output, _ = process.communicate(timeout=timeout)
    assert process.returncode == 0, output[-4000:]
    return output


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def weights(checkpoint_dir) -> dict[str, torch.Tensor]:
    return load_file(str(checkpoint_dir / "model.safetensors"))


def assert_resumed_run_replays(straight_dir: Path, resumed_dir: Path) -> None:
    """The run resumed from straight_dir's checkpoint-2 logged steps 3 and 4 as the straight run
    did and ended on bit-identical weights."""
    import pytest

    straight, resumed = read_jsonl(straight_dir / "metrics.jsonl"), read_jsonl(resumed_dir / "metrics.jsonl")
    assert [row["step"] for row in resumed] == [3, 4]
    for expected, got in zip(straight[2:], resumed, strict=True):
        assert got["reward"] == expected["reward"]
        assert got["loss"] == pytest.approx(expected["loss"], abs=1e-7)
    want, got = weights(straight_dir / "checkpoint-4"), weights(resumed_dir / "checkpoint-4")
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=0, rtol=0, msg=name)


def save_reward_model(directory, chat_template=None):
    """A tiny random Qwen2 sequence classifier (one label) and its char tokenizer in `directory`,
    with `chat_template` as its template (None: none)."""
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    from grpoflow.policy.tiny import PRESETS, build_char_tokenizer

    tokenizer = build_char_tokenizer()
    tokenizer.chat_template = chat_template
    shape = {**PRESETS["tiny"], "intermediate_size": 64, "max_position_embeddings": 128}
    config = Qwen2Config(
        vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id, num_labels=1, **shape
    )
    torch.manual_seed(0)
    Qwen2ForSequenceClassification(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return str(directory)


def stop_process(process: subprocess.Popen, timeout: float = 10) -> None:
    """Terminate `process`, killing it if it has not ended within `timeout` seconds."""
    process.terminate()
    try:
        process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
