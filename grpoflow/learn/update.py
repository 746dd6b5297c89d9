"""What the update phase reads from the run's config: the micro-batching, the sampling that made
the batch, and the importance-sampling correction against the engine's log-probs (`Learner`,
`grpoflow.learn.learner`, runs the update)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from grpoflow.algo.truncation import Truncation
from grpoflow.engines import SamplingParams
from grpoflow.learn.objective import AlgorithmConfig
from grpoflow.options import require


@dataclass(kw_only=True, slots=True)
class ImportanceCorrection:
    """The importance-sampling correction of rollouts that the trainer's policy did not sample
    itself: the loss is weighted by pi_trainer / pi_sampler (`algo.sampling_correction`). The
    option names are TRL's, which names them after vLLM; here they apply to every engine (the
    native engine, rollout servers, a user's rollout function's log-probs)."""

    vllm_importance_sampling_correction: bool | None = None
    """Reweight the loss by pi_trainer / pi_sampler; unset: on for engines that hold their own
    weights (vllm, vllm_server, async_generate), off for those that read the policy's (native,
    hf), whose kernels still round differently from the training forward (the gap is logged)."""
    vllm_importance_sampling_mode: Literal[
        "token_truncate", "token_mask", "sequence_truncate", "sequence_mask"
    ] = "sequence_mask"
    """Ratio per token or per sequence; truncated into, or zeroed outside, the clip range."""
    vllm_importance_sampling_clip_max: float | None = 3.0
    """Upper bound of the importance ratio (None: open)."""
    vllm_importance_sampling_clip_min: float | None = None
    """Lower bound of the importance ratio (None: open)."""

    def __post_init__(self) -> None:
        low, high = self.vllm_importance_sampling_clip_min, self.vllm_importance_sampling_clip_max
        require(
            low is None or high is None or low <= high,
            "vllm_importance_sampling_clip_min",
            f"at most vllm_importance_sampling_clip_max ({high})",
            low,
        )


@dataclass(kw_only=True, slots=True)
class UpdateSettings:
    """What the update phase needs from the run's config."""

    algorithm: AlgorithmConfig
    micro_batch_size: int
    temperature: float
    max_completion_length: int
    max_grad_norm: float
    sampling_correction: ImportanceCorrection | None = None
    """Importance-sampling correction against the engine's log-probs; None trusts them."""
    sampling_logprobs: bool = True
    """The batch carries the engine's log-probs (their gap to the trainer's is logged)."""
    exact_draws: bool = False
    """The engine drew from the trainer's own logits (batch-invariant kernels, `on_policy_check:
    update`): a completion stays in the loss only when every token's engine log-prob equals the
    trainer's bit for bit (`algo.exact_draw_weights`)."""
    truncation: Truncation | None = None
    """top-k/top-p/min-p replayed on the trainer's logits (`replay_sampling_truncation`)."""
    padding_free: bool = False
    """Run each micro-batch's forward passes on its sequences packed end to end in one row."""
    shared_prompts: bool = False
    """Run each micro-batch's forward passes with each group's prompt once, its completions packed
    after it (`algo.shared_prompts`), where the model attends with grpoflow_varlen."""
    max_tokens_per_micro_batch: int | None = None
    """Form micro-batches by this budget of real tokens instead of `micro_batch_size` rows
    (padding_free only)."""
    group_by_length: bool = False
    """Order the rows longest first before cutting micro-batches (`RolloutBatch.by_length`)."""


def replayed_truncation(sampling: SamplingParams, algorithm: AlgorithmConfig) -> Truncation | None:
    """The filters the trainer replays on its logits: the run's top-k/top-p/min-p under
    `replay_sampling_truncation`, else None."""
    truncation = sampling.truncation
    return truncation if algorithm.replay_sampling_truncation and truncation.active else None
