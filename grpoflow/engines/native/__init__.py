"""grpoflow's native rollout engine: continuous batching on a paged KV cache, straight from the
policy module's parameters. See `engine.NativeEngine`."""

from __future__ import annotations

import dataclasses

from grpoflow.engines.native.engine import NativeEngine
from grpoflow.engines.native.sizing import NativeEngineConfig


def build(model, tokenizer, options) -> NativeEngine:
    """Registry factory: a NativeEngine sized by the run's EngineConfig."""
    config = dataclasses.replace(
        NativeEngineConfig.sized_as(options.engine), distribution_positions=options.distribution_positions
    )
    return NativeEngine(model, config=config, tokenizer=tokenizer)


__all__ = ["NativeEngine", "NativeEngineConfig", "build"]
