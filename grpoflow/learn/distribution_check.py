"""The check of the whole next-token distribution between the engine and the trainer: at the few
positions whose distribution the engine kept (`RolloutBatch.engine_distributions`), the total
variation distance and KL(engine || trainer) of the two `softmax(logits / T)`, logged as
`sampling/distribution_{tv,kl}/{mean,max}`.

The trainer's side comes from the forward the learner already runs on a micro-batch's first
pass: its decoder body's last hidden states are read by a forward hook, and only the kept
positions are projected to the vocabulary; where that forward packs its rows (`padding_free`,
shared prompts), the pack's index says which packed state predicts each kept token. Rows of several
sequences and sharded policies are not checked (the metrics are absent for them).
"""

from __future__ import annotations

import torch
from torch import Tensor

from grpoflow.algo.logprobs import decoder_and_head
from grpoflow.algo.packing import PackedSequences
from grpoflow.policy.placement import Placement
from grpoflow.rollout.batch import RolloutBatch


class DistributionTap:
    """Reads the decoder's last hidden states during one forward pass (a context manager), then
    compares the trainer's distributions at the batch's kept positions with the engine's."""

    def __init__(self, placement: Placement, rows: RolloutBatch, temperature: float) -> None:
        self.rows, self.temperature = rows, temperature
        self.decoder, self.head = decoder_and_head(placement.module)
        self.hidden: Tensor | None = None
        self.pack: PackedSequences | None = None
        self.handle = None

    @classmethod
    def for_rows(cls, placement: Placement, rows: RolloutBatch, temperature: float) -> DistributionTap | None:
        """A tap when `rows` carry kept distributions and their forward can be read; else None."""
        if rows.distribution_index is None or placement.is_sharded:  # else >= 1 kept
            return None
        if rows.sequence_starts is not None and bool(rows.sequence_starts.any()):  # multi-turn runs only
            return None
        if decoder_and_head(placement.module) is None:
            return None
        return cls(placement, rows, temperature)

    def __enter__(self) -> DistributionTap:
        def keep(module, args, output) -> None:
            self.hidden = output.last_hidden_state.detach()

        self.handle = self.decoder.register_forward_hook(keep)
        return self

    def __exit__(self, *exc) -> None:
        self.handle.remove()

    def packed(self, pack: PackedSequences) -> None:
        """The forward runs these rows packed as `pack` (its hidden states one row)."""
        self.pack = pack

    def _states(self, rows: Tensor, positions: Tensor) -> Tensor:
        """The hidden state before completion token `positions` of `rows` was drawn."""
        if self.pack is None:
            return self.hidden[rows, self.rows.prompt_ids.shape[1] + positions - 1]
        mask = self.pack.completion_mask
        scored = mask.flatten().cumsum(0) - 1  # each completion token's place in score_index
        at = scored[rows * mask.shape[1] + positions].clamp(min=0)  # a padded candidate: not kept
        return self.hidden[0, self.pack.score_index[at]]

    @torch.no_grad()
    def metrics(self) -> dict[str, Tensor | tuple[Tensor, Tensor]]:
        """`sampling/distribution_{tv,kl}/{mean,max}` over the kept positions of these rows: each
        mean as (sum, count), for `MetricsAccumulator` to average over every micro-batch's
        positions. The rows hold at most as many kept positions as the batch: that many
        candidates, kept ones first, are compared, so that nothing waits for the device."""
        if self.hidden is None:
            return {}
        index = self.rows.distribution_index
        limit = min(len(self.rows.engine_distributions.log_probs), index.numel())
        found, order = (index >= 0).flatten().float().topk(limit, sorted=False)
        kept = found > 0
        rows, positions = order // index.shape[1], order % index.shape[1]
        engine = self.rows.engine_distributions.log_probs[index.flatten()[order].clamp(min=0)]
        trainer = (self.head(self._states(rows, positions)).float() / self.temperature).log_softmax(dim=-1)
        tv, kl = (
            torch.where(kept, d, 0.0) for d in distribution_distances(engine.to(trainer.device), trainer)
        )
        count = kept.sum()
        return {
            "sampling/distribution_tv/mean": (tv.sum(), count),
            "sampling/distribution_tv/max": tv.max(),
            "sampling/distribution_kl/mean": (kl.sum(), count),
            "sampling/distribution_kl/max": kl.max(),
        }


def distribution_distances(engine: Tensor, trainer: Tensor) -> tuple[Tensor, Tensor]:
    """(rows,) total variation distance and KL(engine || trainer) between rows of log-probs
    `(rows, vocab)`; tokens the engine gives no mass add nothing to the KL."""
    p = engine.exp()
    tv = 0.5 * (p - trainer.exp()).abs().sum(dim=-1)
    terms = torch.where(p > 0, p * (engine - trainer), torch.zeros_like(p))
    return tv, terms.sum(dim=-1).clamp(min=0)
