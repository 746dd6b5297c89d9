"""The batch-invariant operations on the CPU without Triton: each row's result the same bits
whatever the other rows are.

`batch_invariant` and `batch_invariant_attention` run these for CPU tensors unless Triton's
interpreter is on (`TRITON_INTERPRET=1`, which runs the Triton kernels themselves, slowly).
Products and norms sum over their depth in a fixed order, one elementwise step per term (exact
IEEE operations, whatever the vector width); attention and log-softmax take a query or row at a
time, copied into a fresh buffer, so the CPU's routines see the same shapes and alignments in a
decode step and in a forward over whole sequences. They are slow: they serve tests and small
models.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F


def triton_runs(tensor: torch.Tensor) -> bool:
    """Whether the Triton kernels run for `tensor`: on CUDA, or anywhere under the interpreter."""
    return tensor.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"


def _fresh(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.clone(memory_format=torch.contiguous_format)


def matmul_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear` (..., K) -> (..., N) summed over k = 0, 1, ... in order, one rounded product
    and one rounded sum per step: every row's arithmetic is its own, on any CPU."""
    rows = x.reshape(-1, x.shape[-1]).float()
    columns = weight.float().T.contiguous()
    out = torch.zeros((rows.shape[0], weight.shape[0]), dtype=torch.float32, device=x.device)
    for k in range(rows.shape[1]):
        out.add_(rows[:, k : k + 1] * columns[k])
    if bias is not None:
        out.add_(bias.float())
    return out.to(x.dtype).view(*x.shape[:-1], weight.shape[0])


def grouped_matmul_rows(x: torch.Tensor, weight: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """Rows x (M, K) sorted by expert, expert e's ending at `ends[e]`, each times its expert's
    weight (E, N, K) transposed by `matmul_rows`: every row's arithmetic its own."""
    out = x.new_empty((x.shape[0], weight.shape[1]))
    start = 0
    for expert, end in enumerate(ends.tolist()):
        if end > start:
            out[start:end] = matmul_rows(x[start:end], weight[expert], None)
        start = end
    return out


def rms_norm_rows(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm, its mean of squares summed in order as `matmul_rows` sums."""
    rows = x.reshape(-1, x.shape[-1]).float()
    squares = torch.zeros(rows.shape[0], dtype=torch.float32, device=x.device)
    for k in range(rows.shape[1]):
        squares.add_(rows[:, k] * rows[:, k])
    inverse = torch.rsqrt(squares / rows.shape[1] + eps)
    return (weight * (rows * inverse[:, None]).to(x.dtype)).view(x.shape)


def log_softmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """float32 log-softmax one row at a time."""
    rows = logits.reshape(-1, logits.shape[-1])
    out = torch.empty(rows.shape, dtype=torch.float32, device=logits.device)
    for index in range(rows.shape[0]):
        out[index] = _fresh(rows[index : index + 1]).float().log_softmax(-1)[0]
    return out.view(logits.shape)


def silu_mul_rows(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """`silu(gate) * up` over (T, I) one row at a time, each in a fresh buffer (differentiable)."""
    rows = [
        F.silu(_fresh(gate[index : index + 1])) * _fresh(up[index : index + 1]) for index in range(len(gate))
    ]
    return torch.cat(rows) if rows else gate * up


def attend_one(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
    """One query position: q (Hq, D) over its keys and values (n, Hkv, D) -> (Hq, D)."""
    num_heads, head_dim = q.shape
    num_kv_heads = keys.shape[1]
    if keys.shape[0] == 0:
        return q.new_zeros(q.shape)
    grouped = _fresh(q.reshape(num_kv_heads, num_heads // num_kv_heads, head_dim))
    k = _fresh(keys.transpose(0, 1))  # (Hkv, n, D)
    v = _fresh(values.transpose(0, 1))
    scores = torch.matmul(grouped.float(), k.float().transpose(1, 2)) * scale
    weights = scores.softmax(-1)
    return torch.matmul(weights, v.float()).to(q.dtype).reshape(num_heads, head_dim)


def attention_rows(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    starts: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Causal attention over whole rows, a query at a time. q (B, Hq, L, D), k and v (B, Hkv, L,
    D), positions and starts (B, L) -> (B, L, Hq, D)."""
    batch, _, length, _ = q.shape
    out = q.new_empty((batch, length, q.shape[1], q.shape[3]))
    for row in range(batch):
        for t in range(length):
            start = int(starts[row, t])
            out[row, t] = attend_one(
                q[row, :, t],
                k[row, :, start : t + 1].transpose(0, 1),
                v[row, :, start : t + 1].transpose(0, 1),
                scale,
            )
    return out


def paged_rows(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    positions: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Queries q (B, T, Hq, D) at `positions` (B, T) over keys 0..position of their row's pages
    in the cache (num_blocks, Hkv, block_size, D); a negative position attends nothing (zeros)."""
    block_size = k_cache.shape[2]
    out = torch.empty_like(q)
    for row in range(q.shape[0]):
        for t in range(q.shape[1]):
            count = int(positions[row, t]) + 1
            pages = block_table[row, : -(-count // block_size)].long()
            keys = k_cache[pages].transpose(1, 2).reshape(-1, *k_cache.shape[1:2], k_cache.shape[3])
            values = v_cache[pages].transpose(1, 2).reshape(-1, *v_cache.shape[1:2], v_cache.shape[3])
            out[row, t] = attend_one(q[row, t], keys[:count], values[:count], scale)
    return out
