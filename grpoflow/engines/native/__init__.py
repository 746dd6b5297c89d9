"""grpoflow's native rollout engine: continuous batching on a paged KV cache, straight from the
policy module's parameters. See `engine.NativeEngine`."""

from __future__ import annotations

import dataclasses

from grpoflow.engines.native.engine import NativeEngine
from grpoflow.engines.native.sizing import NativeEngineConfig
from grpoflow.models.families import refusal

MOE_MODEL_TYPES = ("qwen3_moe",)
"""Mixture-of-experts families of the family path."""


def build(model, tokenizer, options) -> NativeEngine:
    """Registry factory: a NativeEngine sized by the run's EngineConfig."""
    config = NativeEngineConfig.sized_as(options.engine)
    config = dataclasses.replace(
        config,
        distribution_positions=options.distribution_positions,
        batch_invariant=config.batch_invariant or options.batch_invariant,
        record_routing=config.record_routing
        or (options.record_routing and _routes_on_family_path(model, config)),
    )
    return NativeEngine(model, config=config, tokenizer=tokenizer)


def _routes_on_family_path(model, config: NativeEngineConfig) -> bool:
    """A mixture-of-experts model the family path runs (and records the routing of)."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    return model_type in MOE_MODEL_TYPES and not config.force_generic and refusal(model) is None


__all__ = ["NativeEngine", "NativeEngineConfig", "build"]
