"""The options of the GRPO-family objective: loss, advantages, KL and entropy terms.

Names and defaults follow TRL 1.16's GRPOConfig; `adv_estimator`, `kl_estimator` and
`kl_in_reward` follow verl, which TRL has no names for. The settings of the loss types (the clip
range, SAPO's temperatures, VESPO's shape) are the loss types' own dataclasses (`algo.surrogates`),
nested here, so that their flat keys and defaults are declared once.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, fields
from typing import Literal

import torch

from grpoflow.algo import (
    ADV_ESTIMATORS,
    LOSS_TYPES,
    AdaptiveEntropy,
    ClipSettings,
    LossSettings,
    SapoSettings,
    VespoSettings,
    combine_rewards,
    normalize_then_sum_advantages,
)
from grpoflow.algo.estimators import AdvantageEstimator
from grpoflow.distributed import DistributedContext
from grpoflow.imports import load_object
from grpoflow.learn.moe import MoeSettings
from grpoflow.options import choices, require
from grpoflow.rollout.groups import ScoredGroups

logger = logging.getLogger(__name__)


@dataclass(kw_only=True, slots=True)
class AlgorithmConfig:
    """The GRPO-family objective."""

    beta: float = 0.0
    """KL coefficient; 0 loads no reference model."""
    kl_estimator: Literal["k1", "k2", "k3", "low_var_kl"] = "k3"
    """Per-token KL estimator (`algo.KL_ESTIMATORS`); low_var_kl is verl's clipped k3."""
    kl_in_reward: bool = False
    """Subtract beta x the completion's summed KL from its reward before advantages, instead of
    adding the KL to the loss."""
    clip: ClipSettings = field(default_factory=ClipSettings)
    """The clip range of the clipped loss types and CISPO (epsilon, epsilon_high, delta)."""
    num_iterations: int = 1
    """Policy updates per generation batch."""
    loss_type: str = field(default="dapo", metadata=choices(LOSS_TYPES))
    """Per-token surrogate and reduction (`algo.LOSS_TYPES`)."""
    sapo: SapoSettings = field(default_factory=SapoSettings)
    """SAPO's gate temperatures (sapo_temperature_pos, sapo_temperature_neg)."""
    vespo: VespoSettings = field(default_factory=VespoSettings)
    """VESPO's Gamma weight (vespo_k_pos, vespo_lambda_pos, vespo_k_neg, vespo_lambda_neg)."""
    adv_estimator: str = "grpo"
    """How rewards become advantages: grpo, rloo, reinforce_plus_plus, reinforce_plus_plus_baseline
    (`algo.ADV_ESTIMATORS`), or an estimator's import path (`pkg.module:fn`, `file.py:fn`)."""
    multi_objective_aggregation: Literal["sum_then_normalize", "normalize_then_sum"] = "sum_then_normalize"
    """Several rewards: sum them, then compute advantages; or normalise each in its group, sum,
    and normalise the sum over the batch (GDPO)."""
    scale_rewards: Literal["group", "batch", "none"] = "group"
    """Divide advantages by the std of the group, of the batch, or not at all (adv_estimator grpo)."""
    importance_sampling_level: Literal["token", "sequence"] = "token"
    """Ratio per token (GRPO) or per sequence (GSPO)."""
    entropy_coef: float = 0.0
    """Weight of the entropy bonus (mean per-token entropy) subtracted from the loss; the starting
    value under use_adaptive_entropy."""
    use_adaptive_entropy: bool = False
    """Move entropy_coef after each optimizer step towards entropy_target (Skywork-OR1)."""
    entropy_coef_min: float = 0.0
    """Lower bound of the adaptive entropy coefficient."""
    entropy_coef_max: float = 1.0
    """Upper bound of the adaptive entropy coefficient."""
    entropy_coef_delta: float = 0.005
    """Step of the adaptive entropy coefficient per optimizer step."""
    entropy_target: float = 0.2
    """Entropy (nats per token) at or below which the adaptive bonus applies and grows."""
    top_entropy_quantile: float = 1.0
    """Share of completion tokens, highest entropy first, that carry policy loss (1: all)."""
    off_policy_mask_threshold: float | None = None
    """Drop negative-advantage completions whose mean log(pi_sampler / pi) exceeds this (DeepSeek-V3.2)."""
    mask_truncated_completions: bool = False
    """Truncated completions carry no loss (DAPO overlong filtering; alias overlong_filter)."""
    dynamic_sample: bool = False
    """Drop groups whose rewards have zero spread and sample more prompts (DAPO)."""
    max_resample_times: int = 3
    """Most extra sampling rounds per step under dynamic_sample."""
    logprob_chunk_size: int = 1024
    """Tokens per chunk when computing log-probs, bounding the fp32 logits in memory."""
    replay_sampling_truncation: bool = True
    """Under top_p/top_k/min_p, score every completion token (policy, old and reference log-probs)
    under the same filters replayed on the trainer's logits, renormalised over the kept tokens, as
    the engines report them; false: over the whole vocabulary (TRL), which biases the importance
    ratio by the kept mass (TRL #6789)."""
    moe: MoeSettings = field(default_factory=MoeSettings)
    """Mixture-of-experts policies: routing replay, the router's load-balancing loss."""

    def __post_init__(self) -> None:
        require(self.beta >= 0, "beta", ">= 0", self.beta)
        require(self.loss_type in LOSS_TYPES, "loss_type", f"one of {', '.join(LOSS_TYPES)}", self.loss_type)
        for name in ("num_iterations", "logprob_chunk_size"):
            require(getattr(self, name) > 0, name, "> 0", getattr(self, name))
        require(self.max_resample_times >= 0, "max_resample_times", ">= 0", self.max_resample_times)
        require(
            not self.kl_in_reward or self.beta > 0,
            "beta",
            "> 0 under kl_in_reward",
            self.beta,
            "set beta (the KL coefficient) or turn kl_in_reward off",
        )
        require(
            self.adv_estimator in ADV_ESTIMATORS or ":" in self.adv_estimator,
            "adv_estimator",
            f"one of {', '.join(ADV_ESTIMATORS)} or an import path 'pkg.module:function'",
            self.adv_estimator,
        )
        if self.multi_objective_aggregation == "normalize_then_sum":
            require(
                self.adv_estimator == "grpo" and not self.kl_in_reward,
                "multi_objective_aggregation",
                "sum_then_normalize with another adv_estimator or kl_in_reward",
                self.multi_objective_aggregation,
                "normalize_then_sum computes the advantages itself",
            )
        if self.adv_estimator != "grpo" and self.scale_rewards != "group":
            logger.warning(
                "scale_rewards=%s is ignored: it applies to adv_estimator grpo", self.scale_rewards
            )
        self._check_entropy_options()
        self._check_loss_options()

    def _check_loss_options(self) -> None:
        for name in ("epsilon", "epsilon_high"):
            value = getattr(self.clip, name)
            require(value is None or value > 0, name, "> 0", value)
        delta = self.clip.delta
        require(delta is None or delta > 1, "delta", "> 1 (an upper bound on the ratio)", delta)
        for name in ("sapo_temperature_pos", "sapo_temperature_neg"):
            value = getattr(self.sapo, name)
            require(value > 0, name, "> 0 (it divides the gate)", value)
        for name in ("vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg"):
            require(getattr(self.vespo, name) >= 0, name, ">= 0", getattr(self.vespo, name))

    def _check_entropy_options(self) -> None:
        require(self.entropy_coef >= 0, "entropy_coef", ">= 0", self.entropy_coef)
        require(
            0 <= self.top_entropy_quantile <= 1,
            "top_entropy_quantile",
            "in [0, 1]",
            self.top_entropy_quantile,
        )
        threshold = self.off_policy_mask_threshold
        require(
            threshold is None or threshold >= 0, "off_policy_mask_threshold", ">= 0 (or null: off)", threshold
        )
        if not self.use_adaptive_entropy:
            return
        require(self.entropy_coef_delta > 0, "entropy_coef_delta", "> 0", self.entropy_coef_delta)
        require(self.entropy_target >= 0, "entropy_target", ">= 0", self.entropy_target)
        require(
            self.entropy_coef_min <= self.entropy_coef_max,
            "entropy_coef_min",
            f"at most entropy_coef_max ({self.entropy_coef_max})",
            self.entropy_coef_min,
        )

    def entropy_control(self) -> AdaptiveEntropy:
        """A fresh entropy coefficient as the options set it."""
        return AdaptiveEntropy(
            coef=self.entropy_coef,
            adaptive=self.use_adaptive_entropy,
            target=self.entropy_target,
            delta=self.entropy_coef_delta,
            coef_min=self.entropy_coef_min,
            coef_max=self.entropy_coef_max,
        )

    def advantage_estimator(self) -> AdvantageEstimator:
        """The estimator `adv_estimator` names, imported when it is an import path."""
        if self.adv_estimator in ADV_ESTIMATORS:
            return ADV_ESTIMATORS[self.adv_estimator]
        estimator = load_object(self.adv_estimator, "adv_estimator")
        require(callable(estimator), "adv_estimator", "a function's import path", self.adv_estimator)
        return estimator

    def step_advantages(
        self, reward_weights: torch.Tensor, num_generations: int, distributed: DistributedContext
    ) -> StepAdvantages:
        """A step's advantages as these options say, for rewards weighted by `reward_weights`
        in groups of `num_generations` (where the groups give no sizes of their own)."""
        return StepAdvantages(
            algorithm=self,
            estimator=self.advantage_estimator(),
            reward_weights=reward_weights,
            num_generations=num_generations,
            distributed=distributed,
        )

    def loss_settings(self) -> LossSettings:
        """The loss as `algo.policy_loss` takes it. The loss type's settings are the section of
        these options of its settings' class; a plugin's loss type with a class of its own gets its
        defaults. Under kl_in_reward the KL goes into the reward, not the loss."""
        settings_class = LOSS_TYPES[self.loss_type].settings
        sections = (getattr(self, item.name) for item in fields(self))
        return LossSettings(
            loss_type=self.loss_type,
            surrogate_settings=next((s for s in sections if type(s) is settings_class), None),
            importance_sampling_level=self.importance_sampling_level,
            beta=0.0 if self.kl_in_reward else self.beta,
            kl_estimator=self.kl_estimator,
        )


def batch_advantages(
    algorithm: AlgorithmConfig,
    estimator: AdvantageEstimator,
    rewards_per_func: torch.Tensor,
    weights: torch.Tensor,
    num_generations: int | list[int],
    kl: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Advantages `(batch,)` and reward metrics of a whole batch, as `algorithm` says.

    Args:
        rewards_per_func: `(batch, num_funcs)`, NaN where a function gave no reward.
        weights: `(num_funcs,)` reward weights.
        num_generations: the group size, or each group's own size.
        kl: `(batch,)` each completion's KL to the reference under kl_in_reward: `beta * kl` is
            subtracted from its reward (the metrics stay those of the task's rewards, plus
            `reward_kl`, the mean KL).
    """
    if algorithm.multi_objective_aggregation == "normalize_then_sum":
        return normalize_then_sum_advantages(rewards_per_func, weights, num_generations)
    rewards = combine_rewards(rewards_per_func, weights)
    advantages, metrics = estimator(rewards, num_generations, algorithm.scale_rewards)
    if kl is not None:
        kl = kl.to(rewards)
        advantages, _ = estimator(rewards - algorithm.beta * kl, num_generations, algorithm.scale_rewards)
        metrics = {**metrics, "reward_kl": kl.mean()}
    return advantages, metrics


def rank_advantages(
    algorithm: AlgorithmConfig,
    estimator: AdvantageEstimator,
    all_rewards: torch.Tensor,
    weights: torch.Tensor,
    num_generations: int | list[int],
    rank_slice: slice,
    zero_advantage: torch.Tensor | None = None,
    all_kl: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One rank's advantages `(batch,)` and the reward metrics, from the rewards of the global
    batch `(global_batch, num_funcs)` (`batch_advantages` over it, then this rank's `rank_slice`).
    `zero_advantage`: `(batch,)` bool, completions that train with advantage 0; `all_kl`: each
    completion's KL to the reference `(global_batch,)` under kl_in_reward."""
    advantages, metrics = batch_advantages(
        algorithm, estimator, all_rewards, weights.to(all_rewards.device), num_generations, all_kl
    )
    advantages = advantages[rank_slice]
    if zero_advantage is not None:
        advantages = advantages.masked_fill(zero_advantage.to(advantages.device), 0.0)
    return advantages, metrics


@dataclass(frozen=True, slots=True)
class StepAdvantages:
    """Advantages as the objective says (`adv_estimator`, `scale_rewards`, ...), over the global
    batch, then this rank's slice (groups stay whole on one rank)."""

    algorithm: AlgorithmConfig
    estimator: AdvantageEstimator
    reward_weights: torch.Tensor
    """(num_rewards,) how the reward columns add up."""
    num_generations: int
    """The group size, where the groups do not give their own sizes."""
    distributed: DistributedContext

    def __call__(
        self, all_rewards: torch.Tensor, scored: ScoredGroups, all_kl: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """This rank's advantages `(batch,)` and the reward metrics, from every rank's rewards
        `(global_batch, num_rewards)` (and each completion's KL to the reference under
        kl_in_reward); `scored` are this rank's groups."""
        size, rank = len(all_rewards) // self.distributed.world_size, self.distributed.rank
        return rank_advantages(
            self.algorithm,
            self.estimator,
            all_rewards,
            self.reward_weights,
            scored.group_sizes or self.num_generations,
            slice(rank * size, (rank + 1) * size),
            scored.zero_advantage,
            all_kl,
        )
