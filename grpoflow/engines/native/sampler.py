"""Sampling on the device: one pass over the logits, reproducible per request.

Every sampled token is drawn by inversion: one uniform `u` per row, and the token is the first
whose cumulative probability (in vocabulary order, over the tokens that survive top-k / top-p /
min-p) exceeds `u`. The uniform comes from a counter-based hash of the row's key, itself a hash of
(the request's seed, the index of the token being sampled). So a request's completion depends on
its seed alone, not on which other requests share its batch, nor on preemption. The Triton kernel
sums in a different order from this module's torch reference, so the two can part only where `u`
falls within rounding of a boundary between two tokens (about one draw in a million).

Filters reduce to one threshold per row on the scaled logits: a token takes part in the draw iff
its scaled logit is >= the threshold, so top-p needs a sort only when it is asked for.

Log-probs follow vLLM's "processed" convention minus the filters: the returned log-prob of a token
is `log_softmax(penalised_logits / T)[token]` over the whole vocabulary (T = 1 when greedy), which
is what the trainer recomputes as `log_softmax(logits / T)` when repetition_penalty is 1.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from grpoflow.engines.base import SamplingParams

MASK32 = 0xFFFFFFFF
GOLDEN = 0x9E3779B1
MUL1 = 0x7FEB352D
MUL2 = 0x846CA68B


def hash32_numpy(x: np.ndarray) -> np.ndarray:
    """lowbias32 integer hash on uint32 values (a bijection with good avalanche)."""
    x = np.asarray(x, dtype=np.uint64) & MASK32
    x ^= x >> 16
    x = (x * MUL1) & MASK32
    x ^= x >> 15
    x = (x * MUL2) & MASK32
    x ^= x >> 16
    return x


def hash32_torch(x: torch.Tensor) -> torch.Tensor:
    """The same hash on int64 tensors holding uint32 values (products wrap, masks keep 32 bits)."""
    x = x & MASK32
    x = x ^ (x >> 16)
    x = (x * MUL1) & MASK32
    x = x ^ (x >> 15)
    x = (x * MUL2) & MASK32
    return x ^ (x >> 16)


def sequence_seeds(seed: int, prompt_index: np.ndarray, sample_index: np.ndarray) -> np.ndarray:
    """uint32 seed of each sequence from the call's seed, its prompt and its sample index."""
    base = hash32_numpy(np.uint64(seed & MASK32) ^ hash32_numpy(np.uint64((seed >> 32) & MASK32)))
    mixed = hash32_numpy(base ^ hash32_numpy(prompt_index.astype(np.uint64) * 2 + 1))
    return hash32_numpy(mixed + hash32_numpy(sample_index.astype(np.uint64) * 2 + 2))


def row_keys(seeds: np.ndarray, token_index: np.ndarray) -> np.ndarray:
    """uint32 key of the draw that samples token `token_index` of each sequence, as int64."""
    return hash32_numpy(seeds ^ hash32_numpy(token_index.astype(np.uint64) * GOLDEN)).astype(np.int64)


def row_uniforms(keys: torch.Tensor) -> torch.Tensor:
    """(B,) int64 keys -> (B,) float32 uniforms in (0, 1), 24 bits each (the Triton kernel's)."""
    bits = hash32_torch(keys ^ GOLDEN)
    return ((bits >> 8).to(torch.float32) + 0.5) * (1.0 / 16777216.0)


@dataclass(frozen=True, slots=True)
class SamplingOptions:
    """The distribution-shaping part of SamplingParams, shared by every request of a call
    (`from_params`; top_k 0 keeps every token)."""

    temperature: float
    top_k: int
    top_p: float
    min_p: float
    repetition_penalty: float

    @classmethod
    def from_params(cls, params: SamplingParams) -> SamplingOptions:
        return cls(
            temperature=params.temperature,
            top_k=max(params.top_k, 0),
            top_p=params.top_p,
            min_p=params.min_p,
            repetition_penalty=params.repetition_penalty,
        )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def inverse_temperature(self) -> float:
        return 1.0 if self.greedy else 1.0 / self.temperature

    @property
    def filters(self) -> bool:
        return not self.greedy and (self.top_k > 0 or self.top_p < 1 or self.min_p > 0)


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """vLLM/CTRL penalty: seen tokens' positive logits divided by `penalty`, negative ones multiplied.

    logits: (B, V) float32; seen: (B, V) bool. Returns a new tensor.
    """
    penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
    return torch.where(seen, penalised, logits)


def filter_thresholds(scaled: torch.Tensor, options: SamplingOptions) -> torch.Tensor | None:
    """(B, V) scaled logits -> (B,) smallest scaled logit still allowed in the draw, or None.

    Top-p is taken over the top-k survivors renormalised (vLLM's order); min-p against the full
    distribution's top probability. Ties at the threshold all stay in.
    """
    if not options.filters:
        return None
    vocab_size = scaled.shape[-1]
    thresholds = torch.full(scaled.shape[:1], -torch.inf, device=scaled.device)
    if options.top_p < 1:
        ordered = scaled.sort(dim=-1, descending=True).values
        if 0 < options.top_k < vocab_size:
            ordered[:, options.top_k :] = -torch.inf
        probs = ordered.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        keep = (mass_before < options.top_p).sum(dim=-1).clamp(min=1)
        thresholds = ordered.gather(1, (keep - 1)[:, None])[:, 0]
    elif 0 < options.top_k < vocab_size:
        thresholds = scaled.topk(options.top_k, dim=-1).values[:, -1]
    if options.min_p > 0:
        floor = scaled.max(dim=-1).values + float(np.log(options.min_p))
        thresholds = torch.maximum(thresholds, floor)
    return thresholds


def sample_reference(
    logits: torch.Tensor,
    keys: torch.Tensor,
    inverse_temperature: float,
    greedy: bool,
    thresholds: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pure-torch sampler. logits (B, V) any float dtype; keys (B,) int64.

    Returns tokens (B,) int64 and their log-probs (B,) float32.
    """
    scaled = logits.float() * inverse_temperature
    log_probs = scaled.log_softmax(dim=-1)
    allowed = torch.ones_like(scaled, dtype=torch.bool)
    if thresholds is not None:
        allowed = scaled >= thresholds[:, None]
    if greedy:
        tokens = scaled.masked_fill(~allowed, -torch.inf).argmax(dim=-1)
    else:
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


def sample(
    logits: torch.Tensor,
    keys: torch.Tensor,
    options: SamplingOptions,
    *,
    seen: torch.Tensor | None = None,
    use_triton: bool = False,
    tokens_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row. logits (B, V); keys (B,) int64; seen (B, V) bool or None.

    Returns tokens (B,) int64 (written into `tokens_out` when given) and log-probs (B,) float32,
    both on the logits' device.
    """
    if options.repetition_penalty != 1 and seen is not None:
        logits = apply_repetition_penalty(logits.float(), seen, options.repetition_penalty)
    thresholds = None
    if options.filters:
        thresholds = filter_thresholds(logits.float() * options.inverse_temperature, options)
    args = (logits, keys, options.inverse_temperature, options.greedy, thresholds)
    if use_triton:
        from grpoflow.engines.native.kernels import sample_rows

        return sample_rows(*args, tokens_out=tokens_out)
    tokens, logprobs = sample_reference(*args)
    if tokens_out is None:
        return tokens, logprobs
    return tokens_out.copy_(tokens), logprobs
