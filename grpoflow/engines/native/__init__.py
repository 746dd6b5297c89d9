"""grpoflow's native rollout engine: continuous batching on a paged KV cache, straight from the
policy module's parameters. See `engine.NativeEngine`."""

from __future__ import annotations

from grpoflow.engines.native.config import NativeEngineConfig
from grpoflow.engines.native.engine import NativeEngine


def build(model, tokenizer, options) -> NativeEngine:
    """Registry factory: a NativeEngine sized from the run's EngineOptions."""
    config = NativeEngineConfig(
        max_model_len=options.max_model_len,
        gpu_memory_utilization=options.gpu_memory_utilization,
        max_num_seqs=getattr(options, "max_num_seqs", 256),
    )
    return NativeEngine(model, config=config, tokenizer=tokenizer)


__all__ = ["NativeEngine", "NativeEngineConfig", "build"]
