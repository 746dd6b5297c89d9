"""Rollout engines by name, imported only when chosen (a heavy backend loads only if used).

Each entry is the dotted path of a factory `build(model, tokenizer, options) -> RolloutEngine`.
"""

from __future__ import annotations

import importlib

from grpoflow.engines.base import (
    Completion,
    EngineCapabilities,
    EngineConfig,
    EngineOptions,
    EngineStats,
    NonFiniteLogits,
    PrefillStats,
    RolloutEngine,
    SamplingParams,
    prefix_cache_metrics,
)

ENGINES: dict[str, str] = {
    "hf": "grpoflow.engines.hf:build",
    "vllm": "grpoflow.engines.vllm:build",
    "vllm_server": "grpoflow.remote.engine:build",
    "native": "grpoflow.engines.native:build",
}


def build_engine(name: str, model, tokenizer, options: EngineOptions) -> RolloutEngine:
    """Build the engine registered as `name` around the live policy `model`."""
    if name not in ENGINES:
        raise ValueError(f"unknown rollout engine {name!r}; known: {', '.join(sorted(ENGINES))}")
    module_name, _, factory_name = ENGINES[name].partition(":")
    factory = getattr(importlib.import_module(module_name), factory_name)
    return factory(model, tokenizer, options)


__all__ = [
    "ENGINES",
    "Completion",
    "EngineCapabilities",
    "EngineConfig",
    "EngineOptions",
    "EngineStats",
    "NonFiniteLogits",
    "PrefillStats",
    "RolloutEngine",
    "SamplingParams",
    "build_engine",
    "prefix_cache_metrics",
]
