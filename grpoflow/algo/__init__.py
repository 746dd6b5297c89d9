"""The GRPO-family algorithm as pure tensor functions: advantages, log-probs, KL, losses, filters."""

from grpoflow.algo.advantages import (
    SCALE_MODES,
    combine_rewards,
    group_advantages,
    group_reward_std,
    normalize_then_sum_advantages,
)
from grpoflow.algo.entropy import AdaptiveEntropy, entropy_bonus, high_entropy_mask
from grpoflow.algo.estimators import ADV_ESTIMATORS, adv_estimator, register_adv_estimator
from grpoflow.algo.filters import off_policy_mask, overlong_mask, select_groups, zero_std_groups
from grpoflow.algo.importance import (
    SAMPLING_CORRECTION_MODES,
    exact_draw_weights,
    sampling_correction,
    sampling_logp_gap,
)
from grpoflow.algo.kl import KL_ESTIMATORS, k3_kl, kl_estimate, sequence_kl
from grpoflow.algo.logprobs import (
    LogprobOptions,
    packed_sequence_logprobs,
    position_ids_from_mask,
    selective_log_softmax,
    sequence_logprobs,
    token_logprobs_from_hidden,
)
from grpoflow.algo.loss_types import (
    LOSS_REDUCTIONS,
    LOSS_TYPES,
    BatchTotals,
    LossType,
    loss_type,
    register_loss,
)
from grpoflow.algo.losses import IMPORTANCE_SAMPLING_LEVELS, LossSettings, micro_batch_scale, policy_loss
from grpoflow.algo.packing import (
    PackedSequences,
    check_packed_attention,
    pack_sequences,
    token_budget_batches,
    unpack,
)
from grpoflow.algo.surrogates import ClipSettings, SapoSettings, SurrogateInputs, VespoSettings

__all__ = [
    "AdaptiveEntropy",
    "BatchTotals",
    "ClipSettings",
    "KL_ESTIMATORS",
    "ADV_ESTIMATORS",
    "IMPORTANCE_SAMPLING_LEVELS",
    "LOSS_REDUCTIONS",
    "LOSS_TYPES",
    "LogprobOptions",
    "LossSettings",
    "LossType",
    "PackedSequences",
    "SAMPLING_CORRECTION_MODES",
    "SCALE_MODES",
    "SapoSettings",
    "SurrogateInputs",
    "VespoSettings",
    "adv_estimator",
    "check_packed_attention",
    "combine_rewards",
    "group_advantages",
    "group_reward_std",
    "entropy_bonus",
    "high_entropy_mask",
    "k3_kl",
    "kl_estimate",
    "loss_type",
    "micro_batch_scale",
    "normalize_then_sum_advantages",
    "off_policy_mask",
    "overlong_mask",
    "pack_sequences",
    "packed_sequence_logprobs",
    "policy_loss",
    "position_ids_from_mask",
    "register_adv_estimator",
    "register_loss",
    "exact_draw_weights",
    "sampling_correction",
    "sampling_logp_gap",
    "select_groups",
    "selective_log_softmax",
    "sequence_kl",
    "sequence_logprobs",
    "token_budget_batches",
    "token_logprobs_from_hidden",
    "unpack",
    "zero_std_groups",
]
