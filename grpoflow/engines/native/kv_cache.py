"""The paged KV cache: one tensor, sized from a memory budget, handed out in blocks (`block_pool`)."""

from __future__ import annotations

import math

import torch

from grpoflow.engines.native.sizing import NativeEngineConfig
from grpoflow.models.model import Shape


def block_bytes(shape: Shape, block_size: int, dtype: torch.dtype, record_routing: bool = False) -> int:
    """Bytes of one block over all layers, keys and values (and the experts chosen for its tokens,
    16 bits each, when routing is recorded)."""
    element = torch.empty((), dtype=dtype).element_size()
    routing = 2 * shape.routing_width * block_size if record_routing else 0
    return shape.num_layers * 2 * shape.num_kv_heads * block_size * shape.head_dim * element + routing


def workspace_bytes(shape: Shape, config: NativeEngineConfig, dtype: torch.dtype) -> int:
    """A generous bound on what generation needs beside the cache: logits and sampler temporaries
    for a full decode batch, and the activations of the largest prefill."""
    element = torch.empty((), dtype=dtype).element_size()
    rows = config.max_num_seqs
    decode = rows * shape.vocab_size * (element + 16)
    tokens = config.max_prefill_tokens
    prefill = tokens * (4 * shape.intermediate_size + 12 * shape.hidden_size + shape.sparse_width) * element
    return decode + prefill + (512 << 20)


def num_blocks_for(
    shape: Shape, config: NativeEngineConfig, max_model_len: int, device: torch.device, dtype: torch.dtype
) -> int:
    """How many blocks to allocate: config.num_kv_blocks, else what the memory budget allows
    (CUDA), else enough for max_num_seqs full-length sequences (CPU)."""
    blocks_per_sequence = math.ceil(max_model_len / config.block_size)
    useful = config.max_num_seqs * blocks_per_sequence
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    if device.type != "cuda":
        return useful
    free, total = torch.cuda.mem_get_info(device)
    budget = total * config.gpu_memory_utilization - torch.cuda.memory_reserved(device)
    budget = min(budget, free) - workspace_bytes(shape, config, dtype)
    per_block = block_bytes(shape, config.block_size, dtype, config.record_routing)
    if budget < per_block * blocks_per_sequence:
        raise ValueError(
            f"gpu_memory_utilization={config.gpu_memory_utilization} leaves "
            f"{max(budget, 0) / 2**30:.2f} GiB for the KV cache, less than one sequence of "
            f"max_model_len={max_model_len} needs ({per_block * blocks_per_sequence / 2**30:.2f} GiB); "
            "raise gpu_memory_utilization, lower max_model_len or max_num_seqs, or free GPU memory"
        )
    return int(min(budget // per_block, useful))


def allocate_cache(
    shape: Shape, num_blocks: int, block_size: int, device: torch.device, dtype: torch.dtype
) -> torch.Tensor:
    """(layers, 2, num_blocks, Hkv, block_size, D): a block of one head is contiguous."""
    return torch.zeros(
        (shape.num_layers, 2, num_blocks, shape.num_kv_heads, block_size, shape.head_dim),
        device=device,
        dtype=dtype,
    )
