"""Helpers shared by the end-to-end tests: quick configs on the embedded default, reward plugins."""

from __future__ import annotations

from pathlib import Path

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
