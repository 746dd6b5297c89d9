"""Sampling on the device: one pass over the logits, reproducible per request.

Every sampled token is a keyed draw (`grpoflow.algo.draws`): one uniform `u` per row, and the
token is the first whose cumulative probability (in vocabulary order, over the tokens that survive
top-k / top-p / min-p) exceeds `u`. The uniform comes from a counter-based hash of the row's key,
itself a hash of (the request's seed, the index of the token being sampled). So a request's
completion depends on its seed alone, not on which other requests share its batch, nor on
preemption; and the trainer can replay any draw on its own logits. The Triton kernel sums in a
different order from the torch reference, so the two can part only where `u` falls within
rounding of a boundary between two tokens (about one draw in a million).

Filters reduce to one threshold per row on the scaled logits (`grpoflow.algo.truncation`): a token
takes part in the draw iff its scaled logit is >= the threshold, so top-p needs a sort only when it
is asked for.

Log-probs follow vLLM's `processed_logprobs`: the returned log-prob of a token is that of the
distribution it was drawn from, `log_softmax(penalised_logits / T)` renormalised over the tokens
the filters keep (the whole vocabulary at T = 1 when greedy). The trainer replays the filters on
its own logits (`replay_sampling_truncation`), so both sides score on one support.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from grpoflow.algo.draws import gumbel_draw, row_keys, sequence_seeds
from grpoflow.algo.draws import keyed_draw as sample_reference
from grpoflow.algo.logprobs import invariant_token_logprobs
from grpoflow.algo.truncation import Truncation
from grpoflow.engines.base import SamplingParams

__all__ = ["SamplingOptions", "row_keys", "sample", "sample_reference", "sequence_seeds"]


@dataclass(frozen=True, slots=True)
class SamplingOptions:
    """The distribution-shaping part of SamplingParams, shared by every request of a call
    (`from_params`; top_k 0 keeps every token)."""

    temperature: float
    top_k: int
    top_p: float
    min_p: float
    repetition_penalty: float
    draw: str = "inversion"

    @classmethod
    def from_params(cls, params: SamplingParams) -> SamplingOptions:
        return cls(
            temperature=params.temperature,
            top_k=max(params.top_k, 0),
            top_p=params.top_p,
            min_p=params.min_p,
            repetition_penalty=params.repetition_penalty,
            draw=params.draw,
        )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def inverse_temperature(self) -> float:
        return 1.0 if self.greedy else 1.0 / self.temperature

    @property
    def truncation(self) -> Truncation:
        return Truncation(top_k=self.top_k, top_p=self.top_p, min_p=self.min_p)

    @property
    def filters(self) -> bool:
        return not self.greedy and self.truncation.active


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """vLLM/CTRL penalty: seen tokens' positive logits divided by `penalty`, negative ones multiplied.

    logits: (B, V) float32; seen: (B, V) bool. Returns a new tensor.
    """
    penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
    return torch.where(seen, penalised, logits)


def sample(
    logits: torch.Tensor,
    keys: torch.Tensor,
    options: SamplingOptions,
    *,
    seen: torch.Tensor | None = None,
    use_triton: bool = False,
    tokens_out: torch.Tensor | None = None,
    invariant_scores: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row. logits (B, V); keys (B,) int64; seen (B, V) bool or None.
    `invariant_scores` (a batch-invariant engine): the log-probs of a draw from the whole
    distribution are `invariant_token_logprobs`', bit for bit the trainer's on the same logits.

    Returns tokens (B,) int64 (written into `tokens_out` when given) and log-probs (B,) float32,
    both on the logits' device.
    """
    if options.repetition_penalty != 1 and seen is not None:
        logits = apply_repetition_penalty(logits.float(), seen, options.repetition_penalty)
    thresholds = None
    if options.filters:
        thresholds = options.truncation.thresholds(logits.float() * options.inverse_temperature)
    args = (logits, keys, options.inverse_temperature, options.greedy, thresholds)
    if options.draw == "gumbel" and not options.greedy:
        tokens, logprobs = gumbel_draw(logits, keys, options.inverse_temperature, thresholds)
    elif use_triton:
        from grpoflow.kernels.decoder import sample_rows

        tokens, logprobs = sample_rows(*args, tokens_out=tokens_out)
    else:
        tokens, logprobs = sample_reference(*args)
    if invariant_scores and not (options.greedy or thresholds is not None or options.repetition_penalty != 1):
        logprobs = invariant_token_logprobs(logits, tokens, options.temperature)
    if tokens_out is None or tokens is tokens_out:
        return tokens, logprobs
    return tokens_out.copy_(tokens), logprobs
