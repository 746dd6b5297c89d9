"""What the learner does for a mixture-of-experts policy: its options (routing replay, the router's
load-balancing loss), which batches replay the engine's routing, and the loss term and metrics of
a forward pass's routing (`grpoflow.policy.routing_replay` hooks the routers)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from grpoflow.options import require
from grpoflow.policy.batch_invariant import installed
from grpoflow.policy.routing_replay import MoeRouters, RoutingRecord, is_moe_config, moe_routers
from grpoflow.rollout.batch import RolloutBatch


@dataclass(kw_only=True, slots=True)
class MoeSettings:
    """Mixture-of-experts policies: routing replay and the router's auxiliary loss."""

    routing_replay: bool | Literal["auto"] = "auto"
    """Send each token of the training forward passes (policy, old policy, reference) through the
    experts the rollout engine routed it to, the gate weights still the router's own softmax
    probabilities at those experts (so the router trains); tokens without a record use the
    router's choice. auto: on for a MoE policy whenever the engine recorded its routing, except
    on the batch-invariant kernels, whose routers choose the engine's experts bit for bit (the
    engine then records none)."""
    router_aux_loss_coef: float | None = None
    """Weight of the routers' load-balancing loss (transformers' formula, `algo.load_balancing`)
    added to a MoE policy's loss; None: the model config's `router_aux_loss_coef`; 0: off."""

    def __post_init__(self) -> None:
        coef = self.router_aux_loss_coef
        require(coef is None or coef >= 0, "router_aux_loss_coef", ">= 0 (0: off; null: the model's)", coef)

    def replays_recorded(self, kernels: bool) -> bool:
        """Whether recorded routing is replayed (so the engine is to record it): routing_replay
        true, or auto without the batch-invariant kernels (`kernels`)."""
        return self.routing_replay is True or (self.routing_replay == "auto" and not kernels)


class MoeTraining:
    """The routers of a policy (and of its reference model) during the learner's passes; a policy
    without MoE routers passes through untouched."""

    def __init__(self, settings: MoeSettings, model: nn.Module, reference: nn.Module | None = None) -> None:
        self.settings = settings
        self.replay_recorded = settings.replays_recorded(installed(model))
        self.routers: MoeRouters | None = moe_routers(model)
        self.ref_routers = moe_routers(reference) if reference is not None else None
        if settings.routing_replay is True and self.routers is None:
            raise ValueError(_not_replayable(model))
        coef = settings.router_aux_loss_coef
        if coef is None:
            coef = self.routers.default_aux_loss_coef if self.routers is not None else 0.0
        self.aux_loss_coef = coef if self.routers is not None else 0.0

    def replays(self, batch: RolloutBatch) -> bool:
        """Whether `batch`'s passes replay the engine's routing (module docstring)."""
        asked = self.settings.routing_replay
        if not self.replay_recorded or self.routers is None:
            return False
        several = batch.sequence_starts is not None and bool(batch.sequence_starts.any())
        if batch.routed_experts is None or several:
            if asked is True:
                raise ValueError(
                    "routing_replay: true needs every batch's routing recorded by the engine "
                    "(Completion.routed_experts) on rows of one sequence each; "
                    + (
                        "this batch holds multi-turn rows of several sequences"
                        if several
                        else "this batch has none"
                    )
                    + ": set routing_replay: auto to replay it where it is recorded"
                )
            return False
        _check_experts(batch.routed_experts, self.routers)
        return True

    @contextmanager
    def policy_pass(self, replay: bool) -> Iterator[RoutingRecord | None]:
        """The policy's routers hooked for one micro-batch's forward and backward passes."""
        if self.routers is None:
            yield None
            return
        record = RoutingRecord(replay=replay, keep_logits=self.aux_loss_coef > 0)
        with self.routers.hooked(record):
            yield record

    def loss_term(
        self, record: RoutingRecord | None, metrics: dict, *, num_micro_batches: int, first_pass: bool
    ) -> torch.Tensor | float:
        """The router's weighted load-balancing loss for one micro-batch, and into `metrics` its
        value (`loss/router_aux`) and on a batch's first pass the fraction of recorded routings
        the router itself would have sent elsewhere (`routing/mismatch_fraction`)."""
        if record is None:
            return 0.0
        fraction = record.mismatch_fraction() if first_pass else None
        if fraction is not None:
            metrics["routing/mismatch_fraction"] = fraction
        if self.aux_loss_coef == 0:
            return 0.0
        aux = self.routers.aux_loss(record)
        metrics["loss/router_aux"] = aux.detach()
        return self.aux_loss_coef * aux / num_micro_batches


def _check_experts(routed: torch.Tensor, routers: MoeRouters) -> None:
    """The recorded routing fits the policy: one entry per MoE layer and expert slot, each an
    expert it has (or -1)."""
    layers, top_k = len(routers.routers), routers.top_k
    if tuple(routed.shape[2:]) != (layers, top_k):
        raise ValueError(
            f"the engine recorded routing over {routed.shape[2]} layers of {routed.shape[3]} experts each; "
            f"the policy has {layers} MoE layers of top_k {top_k}: the engine must serve the policy's model"
        )
    low, high = int(routed.min()), int(routed.max())
    if low < -1 or high >= routers.num_experts:
        raise ValueError(
            f"the engine recorded experts {low}..{high}; the policy has experts 0..{routers.num_experts - 1} "
            "(-1: not recorded): the engine must serve the policy's model"
        )


def _not_replayable(model: nn.Module) -> str:
    config = getattr(model, "config", None)
    if config is not None and is_moe_config(config):
        return (
            f"routing_replay: true covers the softmax top-k routers of Qwen2/Qwen3-MoE, Qwen3-Next, OLMoE "
            f"and Mixtral; this model ({type(model).__name__}) routes otherwise: set routing_replay: false"
        )
    return "routing_replay: true needs a mixture-of-experts policy; this one has no experts: set routing_replay: auto"
