"""Sizes and switches of the native rollout engine."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from grpoflow.engines.base import EngineConfig
from grpoflow.options import require


@dataclass(kw_only=True, slots=True)
class NativeEngineConfig(EngineConfig):
    """`EngineConfig`'s sizes (gpu_memory_utilization, max_num_seqs, max_model_len) plus the native
    engine's own; names follow vLLM's engine arguments where they exist."""

    block_size: int = 32
    """Tokens per KV-cache block (page)."""
    num_kv_blocks: int | None = None
    """KV-cache blocks to allocate; None sizes the cache from gpu_memory_utilization (CUDA) or
    from max_num_seqs * max_model_len (CPU)."""
    max_prefill_tokens: int = 16384
    """Most tokens (padded) in one prefill step; a longer single prompt still runs alone."""
    use_cuda_graphs: bool = True
    """Capture decode steps as CUDA graphs, one per batch-size bucket (CUDA with Triton only)."""
    use_triton: bool = True
    """Use the Triton kernels on CUDA; False runs the pure-torch reference ops everywhere."""
    fuse_projections: bool = True
    """Lay each layer's q/k/v and gate/up weights back to back in one buffer (the parameters keep
    their identity; done once, when the engine is built) so that each group runs as one product."""
    force_generic: bool = False
    """Run every model through the generic path (the HF module with its own cache)."""
    enable_prefix_caching: bool = True
    """Keep the KV blocks of prompts and completions across generate calls, keyed by their
    tokens, so a prompt that starts with a cached prefix (a GRPO group's shared prompt, a
    multi-turn episode's earlier turns) prefills only the rest; dropped when the weights change,
    on sleep and by `reset_prefix_cache` (family path only)."""
    prefill_wait_steps: int = 8
    """Requests that join a running call (a server's, a run's hosted agent programs') and are
    fewer than an eighth of max_num_seqs wait up to this many decode steps for others before they
    are prefilled, so requests that arrive one by one share prefill steps instead of taking one
    each; 0 prefills each as soon as rows are free. Prompts a call starts with never wait."""
    distribution_positions: int = 0
    """Sampled positions per call whose whole next-token distribution the completions carry
    (`Completion.distributions`; 0: none)."""
    record_routing: bool = False
    """Return with each completion the experts a mixture-of-experts model chose at each of its
    positions (`Completion.routed_experts`), prompt positions served from the prefix cache
    included; family path only."""
    batch_invariant: bool = False
    """Run the family forward on the batch-invariant kernels (Qwen2, Llama and Qwen3 layouts, LoRA
    layers included), whose logits equal the training forward's bit for bit under
    `grpoflow.policy.batch_invariant`."""
    max_lora_rank: int = 64
    """The largest rank of an adapter sent as tensors (`grpoflow.transport.adapters`) the engine
    takes (vLLM's --max-lora-rank); a LoRA policy's own layers are not bounded by it."""

    def __post_init__(self) -> None:
        EngineConfig.__post_init__(self)
        require(
            self.block_size >= 1 and not self.block_size & (self.block_size - 1),
            "block_size",
            "a power of two",
            self.block_size,
        )
        require(
            self.num_kv_blocks is None or self.num_kv_blocks >= 1,
            "num_kv_blocks",
            ">= 1 (or unset)",
            self.num_kv_blocks,
        )
        require(self.max_lora_rank >= 1, "max_lora_rank", ">= 1", self.max_lora_rank)
        require(self.prefill_wait_steps >= 0, "prefill_wait_steps", ">= 0", self.prefill_wait_steps)
        require(self.max_prefill_tokens >= 1, "max_prefill_tokens", ">= 1", self.max_prefill_tokens)

    @classmethod
    def sized_as(cls, engine: EngineConfig) -> NativeEngineConfig:
        """The native engine's settings with `engine`'s sizes and its own defaults (`engine`
        itself when it already is the native engine's, e.g. with num_kv_blocks from a plan)."""
        if isinstance(engine, NativeEngineConfig):
            return engine
        return cls(**{item.name: getattr(engine, item.name) for item in dataclasses.fields(EngineConfig)})
