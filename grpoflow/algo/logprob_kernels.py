"""Triton kernels for the vocabulary log-softmax of `_LinearLogProb` on CUDA.

The eager path turns a `(tokens, vocab)` chunk of bf16 logits into float32 and walks it five to
eight times (scale, logsumexp, gather, entropy; in backward: exp, scale, scatter, cast). For a
152K vocabulary those passes, not the projection's matrix products, dominate the update phase. Here
one kernel reads the bf16 logits once and writes the logsumexp, the target log-prob and the entropy
of each row (an online softmax over blocks of the vocabulary), and one kernel overwrites the logits
with the gradient `(onehot(target) - softmax) * grad / temperature` in bf16, in place. The
arithmetic is float32 inside the kernels, as in the eager path.

Imported only on CUDA with Triton; `tests/algo/test_logprob_kernels.py` checks both kernels
against the eager path on the GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 4096
"""Vocabulary columns a program handles per iteration."""


@triton.jit
def _logprob_forward_kernel(
    logits_ptr, targets_ptr, lse_ptr, logp_ptr, entropy_ptr, num_cols, stride_row, inv_temperature,
    COMPUTE_ENTROPY: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride_row
    cols = tl.arange(0, BLOCK)
    running_max = tl.full((), float("-inf"), tl.float32)
    running_sum = tl.zeros((), tl.float32)
    running_dot = tl.zeros((), tl.float32)  # sum of exp(x - max) * x, for the entropy
    for start in range(0, num_cols, BLOCK):
        mask = start + cols < num_cols
        x = tl.load(base + start + cols, mask=mask, other=float("-inf")).to(tl.float32) * inv_temperature
        new_max = tl.maximum(running_max, tl.max(x, axis=0))
        rescale = tl.exp(running_max - new_max)
        weights = tl.where(mask, tl.exp(x - new_max), 0.0)
        running_sum = running_sum * rescale + tl.sum(weights, axis=0)
        if COMPUTE_ENTROPY:
            running_dot = running_dot * rescale + tl.sum(weights * tl.where(mask, x, 0.0), axis=0)
        running_max = new_max
    lse = running_max + tl.log(running_sum)
    target = tl.load(targets_ptr + row)
    target_logit = tl.load(base + target).to(tl.float32) * inv_temperature
    tl.store(lse_ptr + row, lse)
    tl.store(logp_ptr + row, target_logit - lse)
    if COMPUTE_ENTROPY:
        tl.store(entropy_ptr + row, lse - running_dot / running_sum)


@triton.jit
def _logprob_backward_kernel(
    logits_ptr, targets_ptr, lse_ptr, grad_ptr, num_cols, stride_row, inv_temperature,
    BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride_row
    cols = tl.arange(0, BLOCK)
    lse = tl.load(lse_ptr + row)
    target = tl.load(targets_ptr + row)
    scale = tl.load(grad_ptr + row) * inv_temperature
    for start in range(0, num_cols, BLOCK):
        mask = start + cols < num_cols
        x = tl.load(base + start + cols, mask=mask, other=0.0).to(tl.float32) * inv_temperature
        grad = (tl.where(start + cols == target, 1.0, 0.0) - tl.exp(x - lse)) * scale
        tl.store(base + start + cols, grad.to(logits_ptr.dtype.element_ty), mask=mask)


def fused_log_softmax_forward(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float, compute_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """`(rows, vocab)` logits (any float dtype, rows contiguous) and `(rows,)` targets ->
    log-probs, logsumexps and entropies (or None), `(rows,)` float32 each, of softmax(logits / T)."""
    rows, vocab = logits.shape
    assert logits.stride(1) == 1, "the vocabulary dimension must be contiguous"
    lse = torch.empty(rows, device=logits.device, dtype=torch.float32)
    logp = torch.empty_like(lse)
    entropy = torch.empty_like(lse) if compute_entropy else lse
    if rows:
        _logprob_forward_kernel[(rows,)](
            logits, targets, lse, logp, entropy, vocab, logits.stride(0), 1.0 / temperature,
            COMPUTE_ENTROPY=compute_entropy, BLOCK=BLOCK, num_warps=8,
        )  # fmt: skip
    return logp, lse, entropy if compute_entropy else None


def fused_log_softmax_backward_(
    logits: torch.Tensor,
    targets: torch.Tensor,
    lse: torch.Tensor,
    grad_logp: torch.Tensor,
    temperature: float,
) -> torch.Tensor:
    """Overwrite `logits` (rows, vocab) with d loss / d (logits before the temperature), given
    d loss / d log_prob (rows,); returns `logits`."""
    rows, vocab = logits.shape
    assert logits.stride(1) == 1, "the vocabulary dimension must be contiguous"
    if rows:
        _logprob_backward_kernel[(rows,)](
            logits, targets, lse, grad_logp.float().contiguous(), vocab, logits.stride(0),
            1.0 / temperature, BLOCK=BLOCK, num_warps=8,
        )  # fmt: skip
    return logits
