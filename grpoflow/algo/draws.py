"""Keyed draws: a token sampled from a row of logits by one uniform that a counter-based hash
derives from the row's key, so anyone holding the logits and the key draws the same token.

The native engine samples this way (its Triton kernel sums in another order, so the two can part
only where the uniform falls within rounding of a boundary between two tokens), and the trainer
replays the engine's draws on its own logits for sampling that is on-policy by construction
(`grpoflow.rollout.on_policy`). A sequence's key stream depends on (seed, prompt index, sample index)
and the index of the token being drawn, never on the batch it was sampled in.

Two ways to draw, the same distribution:
- inversion (`keyed_draw`, the engine's default): the first token, in vocabulary order over the
  tokens the truncation keeps, whose cumulative probability exceeds the row's uniform. One uniform
  per row, one pass over the logits.
- Gumbel-max (`gumbel_draw`): the argmax of the scaled logits plus Gumbel noise, one uniform per
  (row, token) from the row's key and the token's id. Two sets of logits that differ by rounding
  part only where the two best noisy scores are within that rounding of each other, whereas
  inversion parts wherever the cumulative sums up to the uniform differ, which a large vocabulary
  makes likely. So on-policy sampling, which replays the engine's draws on the trainer's logits,
  draws this way.
"""

from __future__ import annotations

import functools

import numpy as np
import torch
from torch import Tensor

MASK32 = 0xFFFFFFFF
GOLDEN = 0x9E3779B1
MUL1 = 0x7FEB352D
MUL2 = 0x846CA68B
TOKEN_SALT = 0x85EBCA6B


def hash32_numpy(x: np.ndarray) -> np.ndarray:
    """lowbias32 integer hash on uint32 values (a bijection with good avalanche)."""
    x = np.asarray(x, dtype=np.uint64) & MASK32
    x ^= x >> 16
    x = (x * MUL1) & MASK32
    x ^= x >> 15
    x = (x * MUL2) & MASK32
    x ^= x >> 16
    return x


def hash32_torch(x: Tensor) -> Tensor:
    """The same hash on int64 tensors holding uint32 values (products wrap, masks keep 32 bits)."""
    x = x & MASK32
    x = x ^ (x >> 16)
    x = (x * MUL1) & MASK32
    x = x ^ (x >> 15)
    x = (x * MUL2) & MASK32
    return x ^ (x >> 16)


def sequence_seeds(seed: int, prompt_index: np.ndarray, sample_index: np.ndarray) -> np.ndarray:
    """uint32 seed of each sequence from a seed, its prompt and its sample index."""
    base = hash32_numpy(np.uint64(seed & MASK32) ^ hash32_numpy(np.uint64((seed >> 32) & MASK32)))
    mixed = hash32_numpy(base ^ hash32_numpy(np.asarray(prompt_index).astype(np.uint64) * 2 + 1))
    return hash32_numpy(mixed + hash32_numpy(np.asarray(sample_index).astype(np.uint64) * 2 + 2))


def row_keys(seeds: np.ndarray, token_index: np.ndarray) -> np.ndarray:
    """int64 key of the draw of token `token_index` (0 = the first completion token) of each
    sequence."""
    return hash32_numpy(seeds ^ hash32_numpy(np.asarray(token_index).astype(np.uint64) * GOLDEN)).astype(
        np.int64
    )


def request_keys(seed: int, sample: int, count: int) -> np.ndarray:
    """(count,) int64 keys of the first `count` draws of sample `sample` of a request seeded with
    `seed` (the native engine's streams for a seeded request)."""
    sequence = sequence_seeds(seed, np.zeros(1, dtype=np.int64), np.array([sample]))
    return row_keys(sequence, np.arange(count))


def uniforms_from_bits(bits: Tensor) -> Tensor:
    """uint32 hashes (in int64) -> float32 uniforms in (0, 1) from their top 24 bits (the Triton
    kernels' conversion)."""
    return ((bits >> 8).to(torch.float32) + 0.5) * (1.0 / 16777216.0)


def row_uniforms(keys: Tensor) -> Tensor:
    """(B,) int64 keys -> (B,) float32 uniforms in (0, 1), 24 bits each."""
    return uniforms_from_bits(hash32_torch(keys ^ GOLDEN))


def keyed_draw(
    logits: Tensor,
    keys: Tensor,
    inverse_temperature: float,
    greedy: bool,
    thresholds: Tensor | None,
) -> tuple[Tensor, Tensor]:
    """Draw one token per row. logits (B, V) any float dtype; keys (B,) int64; thresholds (B,)
    smallest scaled logit in the draw (`Truncation.thresholds`) or None.

    Returns tokens (B,) int64 and their log-probs (B,) float32 under the distribution drawn from:
    `log_softmax(logits * inverse_temperature)` renormalised over the kept tokens (the whole
    vocabulary without thresholds; greedy rows score at temperature 1 over the whole vocabulary).
    """
    scaled = logits.float() * inverse_temperature
    allowed = torch.ones_like(scaled, dtype=torch.bool)
    if thresholds is not None:
        allowed = scaled >= thresholds[:, None]
    if greedy:
        log_probs = scaled.log_softmax(dim=-1)
        tokens = scaled.masked_fill(~allowed, -torch.inf).argmax(dim=-1)
    else:
        log_probs = scaled.masked_fill(~allowed, -torch.inf).log_softmax(dim=-1)
        weights = torch.where(allowed, (scaled - scaled.max(dim=-1, keepdim=True).values).exp(), 0)
        cumulative = weights.double().cumsum(dim=-1)
        targets = row_uniforms(keys).double() * cumulative[:, -1]
        tokens = torch.searchsorted(cumulative, targets[:, None], right=True)[:, 0]
        last_allowed = torch.where(weights > 0, torch.arange(scaled.shape[-1], device=scaled.device), -1)
        tokens = torch.minimum(tokens, last_allowed.max(dim=-1).values)  # a target rounded up to the total
    # A row without a finite logit has no token: it gets token 0 (a valid id for the steps already
    # in flight) and a NaN log-prob, which the engine reports.
    missing = tokens < 0
    tokens = tokens.clamp(min=0)
    return tokens, log_probs.gather(1, tokens[:, None])[:, 0].masked_fill(missing, float("nan"))


def gumbel_uniforms(keys: Tensor, start: int, count: int) -> Tensor:
    """(B,) int64 keys -> (B, count) float32 uniforms in (0, 1) of tokens start..start+count-1."""
    tokens = torch.arange(start, start + count, device=keys.device, dtype=torch.int64)
    bits = hash32_torch(
        hash32_torch(keys ^ GOLDEN)[:, None] ^ hash32_torch(tokens * TOKEN_SALT & MASK32)[None, :]
    )
    return uniforms_from_bits(bits)


def gumbel_draw(
    logits: Tensor,
    keys: Tensor,
    inverse_temperature: float,
    thresholds: Tensor | None,
    block: int = 8192,
) -> tuple[Tensor, Tensor]:
    """Draw one token per row by Gumbel-max: `argmax(scaled + g)` over the kept tokens, with
    `g = -log(-log(u))` and `u` from the row's key and the token id. logits (B, V); keys (B,)
    int64; thresholds as in `keyed_draw`. The noise is made `block` tokens at a time.

    Returns tokens (B,) int64 and their log-probs (B,) float32 under the distribution drawn from.
    On CUDA a Triton kernel does it in one pass (`draw_kernels.py`).
    """
    kernels = _draw_kernels(logits)
    if kernels is not None:
        return kernels.gumbel_rows(logits, keys.to(torch.int64), inverse_temperature, thresholds)
    scaled = logits.float() * inverse_temperature
    if thresholds is not None:
        scaled = scaled.masked_fill(scaled < thresholds[:, None], -torch.inf)
    best = torch.full(scaled.shape[:1], -torch.inf, device=scaled.device)
    tokens = torch.zeros(scaled.shape[:1], dtype=torch.int64, device=scaled.device)
    for start in range(0, scaled.shape[1], block):
        part = scaled[:, start : start + block]
        noisy = part - torch.log(-torch.log(gumbel_uniforms(keys, start, part.shape[1])))
        value, index = noisy.max(dim=-1)
        better = value > best  # the first maximum wins ties, as argmax
        best = torch.where(better, value, best)
        tokens = torch.where(better, index + start, tokens)
    log_probs = scaled.log_softmax(dim=-1).gather(1, tokens[:, None])[:, 0]
    return tokens, log_probs.masked_fill(best == -torch.inf, float("nan"))


def _draw_kernels(logits: Tensor):
    """The Triton draw kernels for CUDA logits with unit last stride when Triton imports, else None."""
    if not (logits.is_cuda and logits.stride(-1) == 1):
        return None
    return _load_kernels()


@functools.cache
def _load_kernels():
    try:
        from grpoflow.algo import draw_kernels
    except ImportError:  # no Triton: the torch path
        return None
    return draw_kernels
