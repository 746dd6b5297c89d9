"""The native engine's decoder operations on the batch-invariant kernels, so that its prefill
and decode steps over the paged cache compute every token's logits bit for bit as the training
forward does with `grpoflow.policy.batch_invariant` installed.

`BatchInvariantOps` keeps the rotary and cache writes (transformers' arithmetic, element by
element: `TritonOps`' kernel on CUDA, `TorchOps`' elsewhere), runs SwiGLU by the training
forward's kernel (`swiglu`), and takes its products (`linear`), RMSNorms (Qwen3's per-head q/k
norms included, a residual's add in the same kernel) and attention from
`batch_invariant` and `batch_invariant_attention`. A prefill always attends through the paged
cache (`paged_prefill`), its cached prefix included. `rotary_tables` is the one computation of
the rotary tables both sides index.
"""

from __future__ import annotations

import torch
from torch import nn

from grpoflow.kernels import batch_invariant as bi
from grpoflow.kernels import batch_invariant_attention as ba
from grpoflow.kernels.ops import CachedPrefix, TorchOps
from grpoflow.kernels.swiglu import silu_mul_forward


@torch.no_grad()
def rotary_tables(rotary_emb: nn.Module, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin (max_position_embeddings, D) in float32, from the model's rotary module over
    every position at once: one computation, whatever positions a forward asks for."""
    length = rotary_emb.config.max_position_embeddings if hasattr(rotary_emb, "config") else None
    if length is None:
        raise ValueError("batch_invariant needs the rotary module's config (max_position_embeddings)")
    probe = torch.zeros(1, device=device, dtype=torch.float32)
    positions = torch.arange(length, device=device)[None]
    cos, sin = rotary_emb.__class__.forward(rotary_emb, probe, positions)
    return cos[0].float(), sin[0].float()


class BatchInvariantOps(TorchOps):
    """`TorchOps` with the batch-invariant kernels' products, norms and attention."""

    name = "batch_invariant"
    paged_prefill = True
    """A prefill attends over the cache it has just written, with or without a cached prefix."""

    @staticmethod
    def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """`F.linear` by `batch_invariant.matmul_forward`."""
        return bi.matmul_forward(x, weight, bias)

    @staticmethod
    def rope_and_store(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
    ) -> None:
        """Qwen3's per-head q/k norms by `batch_invariant.rms_norm_forward` (a row per head, as
        the training forward normalises them before rotary), then rotary as transformers rounds it
        and the cache writes: `TritonOps`' kernel on CUDA (no host synchronisation, so a decode
        step can be captured in a graph), `TorchOps`' elsewhere."""
        if qk_norm is not None:
            q_weight, k_weight, eps = qk_norm
            q.copy_(bi.rms_norm_forward(q, q_weight, eps))
            k.copy_(bi.rms_norm_forward(k, k_weight, eps))
        ops = TorchOps
        if q.is_cuda:
            from grpoflow.kernels.decoder import TritonOps

            ops = TritonOps
        ops.rope_and_store(q, k, v, cos, sin, positions, slots, k_cache, v_cache)

    @staticmethod
    def rms_norm(
        x: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        residual: torch.Tensor | None = None,
        unit_offset: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual added as transformers adds it, then `batch_invariant.rms_norm_forward`;
        both in one kernel (`add_rms_norm_forward`)."""
        if unit_offset:
            raise ValueError("batch_invariant has no unit-offset (Gemma) RMSNorm")
        if residual is not None:
            return bi.add_rms_norm_forward(x, residual, weight, eps)
        return bi.rms_norm_forward(x, weight, eps), x

    @staticmethod
    def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """SwiGLU by `swiglu.silu_mul_forward`, the training forward's kernel."""
        return silu_mul_forward(gate, up)

    @staticmethod
    def decode_attention(
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_table: torch.Tensor,
        context_lens: torch.Tensor,
        scale: float,
        window: int = 0,
        max_context: int = 0,
    ) -> torch.Tensor:
        """Each row's query against its context (`batch_invariant_attention.decode_attention`)."""
        if window:
            raise ValueError("batch_invariant has no sliding-window attention")
        return ba.decode_attention(_unit_heads(q), k_cache, v_cache, block_table, context_lens, scale)

    @staticmethod
    def cached_prefill_attention(
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        prefix: CachedPrefix,
        scale: float,
        window: int,
    ) -> torch.Tensor:
        """A prefill's queries q (G, L, Hq, D) over their items' pages (`paged_attention`)."""
        if window:
            raise ValueError("batch_invariant has no sliding-window attention")
        return ba.paged_attention(
            _unit_heads(q), k_cache, v_cache, prefix.pages, prefix.query_positions, scale
        )


def _unit_heads(q: torch.Tensor) -> torch.Tensor:
    """q as the attention kernels read it: any strides but a unit one along the head dim (a view
    of the fused q/k/v projection is read in place, not copied each layer and step)."""
    return q if q.stride(-1) == 1 else q.contiguous()
