"""The step every attention kernel here takes per block of keys: scores, masking and the online
softmax's running maximum, sum and weighted values, in float32. One function, inlined by Triton
into each kernel: the decode, paged-prefix and batch-invariant attention kernels."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def attend_block(
    q, k, v, visible, m, total, acc, scale, IEEE: tl.constexpr, SUM_BY_DOT: tl.constexpr = False
):
    """Fold one block of keys `k` and values `v` into the running (m, total, acc) of the query
    rows `q`; `visible` (rows, keys) masks the scores. IEEE: float32 products without TF32.
    SUM_BY_DOT: each row's sum of weights as a product with ones, of the weights `acc` takes, so
    that it is the same bits whatever the tile's height (a row reduction's order follows how the
    tile lies across threads; a product sums along its depth in one fixed order)."""
    if IEEE:
        scores = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
    else:
        scores = tl.dot(q, tl.trans(k)) * scale
    scores = tl.where(visible, scores, float("-inf"))
    m_new = tl.maximum(m, tl.max(scores, axis=1))
    alpha = tl.exp(m - m_new)
    p = tl.exp(scores - m_new[:, None])
    weights = p.to(v.dtype)
    if SUM_BY_DOT:
        ones = tl.full([k.shape[0], 16], 1.0, v.dtype)
        if IEEE:
            sums = tl.dot(weights, ones, input_precision="ieee")
        else:
            sums = tl.dot(weights, ones)
        total = total * alpha + tl.max(sums, axis=1)  # 16 equal columns: the max is any of them
    else:
        total = total * alpha + tl.sum(p, axis=1)
    if IEEE:
        acc = acc * alpha[:, None] + tl.dot(weights, v, input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(weights, v)
    return m_new, total, acc
