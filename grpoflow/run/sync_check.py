"""A cheap check, after each weight sync, that the engine really holds the trainer's weights.

Engines that copy weights (colocated vLLM, rollout servers) can keep stale or corrupted tensors
without any error: a parameter left out of an update, a packed copy of a tied head that a reload
missed, a server that silently failed its reload. The check samples a few tokens from a fixed
probe prompt with the engine and compares the engine's log-probs of those tokens with the
trainer's own forward pass; a mean gap above the tolerance stops the run with a message naming the
engine and the step. Numerical differences between engines are far below the default tolerance;
broken weights are far above it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from grpoflow.algo import sequence_logprobs
from grpoflow.data.prompts import PromptItem
from grpoflow.engines import RolloutEngine, SamplingParams
from grpoflow.policy.placement import Placement


class WeightSyncCheckError(RuntimeError):
    """The engine's log-probs disagree with the trainer's after a weight sync."""


class SyncCheck:
    """Compare engine and trainer log-probs on `num_tokens` sampled from `probe_ids`."""

    def __init__(self, probe_ids: Sequence[int], *, tolerance: float, num_tokens: int = 8) -> None:
        if not probe_ids:
            raise ValueError("the weight-sync check needs a non-empty probe prompt")
        self.probe_ids, self.tolerance, self.num_tokens = list(probe_ids), tolerance, num_tokens

    def __call__(self, engine: RolloutEngine, placement: Placement, *, step: int) -> dict[str, float]:
        """Compare `engine` with the placed policy: raise WeightSyncCheckError on a mismatch;
        return the gap as a metric."""
        params = SamplingParams(n=1, max_tokens=self.num_tokens, temperature=1.0, seed=step, ignore_eos=True)
        ((completion,),) = engine.generate([self.probe_ids], params)
        gap = self._gap(placement, completion.token_ids, completion.logprobs)
        if gap > self.tolerance:
            raise WeightSyncCheckError(
                f"after the weight sync of step {step}, the {type(engine).__name__} engine's log-probs "
                f"differ from the trainer's by {gap:.3f} nats per token on average (tolerance "
                f"weight_sync_check_tolerance={self.tolerance}): the engine does not hold the trained "
                "weights. Check the engine's weight-update path (names, dtypes, a failed reload); "
                "weight_sync_check=false skips this check."
            )
        return {"sync/check_logprob_gap": gap}

    def _gap(self, placement: Placement, token_ids: list[int], engine_logprobs: list[float]) -> float:
        if not token_ids:
            return 0.0
        model = placement.module
        ids = torch.tensor([self.probe_ids + list(token_ids)], device=placement.device)
        with placement.evaluating(), torch.no_grad():
            logps, _ = placement.sharded_forward(
                lambda: sequence_logprobs(model, ids, torch.ones_like(ids), logits_to_keep=len(token_ids)),
            )
        engine = torch.tensor(engine_logprobs, dtype=torch.float32)
        return (logps[0].float().cpu() - engine).abs().mean().item()


def probe_ids(items: Sequence[PromptItem], tokenizer) -> list[int]:
    """The prompt the weight-sync check scores: the end of the first prompt, or a fixed text."""
    if items:
        return items[0].prompt_ids[-32:]
    return tokenizer("The weights of the policy and the rollout engine agree.")["input_ids"]
