"""Configuration of the native rollout engine."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(kw_only=True, slots=True)
class NativeEngineConfig:
    """Sizes and switches of `NativeEngine`; names follow vLLM's engine arguments where they exist."""

    max_num_seqs: int = 256
    """Most sequences decoded at once (rows of the decode batch)."""
    max_model_len: int | None = None
    """Longest prompt plus completion in tokens; None takes the model's max_position_embeddings."""
    block_size: int = 32
    """Tokens per KV-cache block (page)."""
    gpu_memory_utilization: float = 0.5
    """Fraction of the GPU's memory this process may hold once the KV cache is allocated."""
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

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"NativeEngineConfig.max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"NativeEngineConfig.max_model_len must be >= 2, got {self.max_model_len}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"NativeEngineConfig.block_size must be a power of two, got {self.block_size}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(
                "NativeEngineConfig.gpu_memory_utilization must be in (0, 1], "
                f"got {self.gpu_memory_utilization}"
            )
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"NativeEngineConfig.num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if self.max_prefill_tokens < 1:
            raise ValueError(
                f"NativeEngineConfig.max_prefill_tokens must be >= 1, got {self.max_prefill_tokens}"
            )
