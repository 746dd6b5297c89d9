"""The policy's weights handed to the rollout engine after an update, tried again on failure and
checked after (`weight_sync_check`)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from grpoflow.data.prompts import PromptItem
from grpoflow.engines import RolloutEngine
from grpoflow.options import require
from grpoflow.phases import phase
from grpoflow.policy.placement import Placement
from grpoflow.run.sync_check import SyncCheck, probe_ids
from grpoflow.transport import WeightSyncError

logger = logging.getLogger("grpoflow.run")


@dataclass(kw_only=True, slots=True)
class WeightSyncConfig:
    """When the trainer's weights go to an engine that keeps its own copy, and the check after."""

    weight_sync_interval: int = 1
    """Send the weights to an engine that keeps its own copy every this many steps (rollouts in
    between use weights up to k-1 steps old)."""
    weight_sync_check: bool = True
    """After each sync to an engine that copies weights, compare its log-probs on a probe prompt
    with the trainer's and stop the run on a mismatch (cost logged as time/sync_check)."""
    weight_sync_check_tolerance: float = 0.5
    """Largest mean log-prob gap (nats per token) the check accepts."""
    weight_sync_retries: int = 2
    """Further tries of a weight sync that failed (a collective group is set up afresh for each);
    when they fail too, the run stops with a checkpoint of the step just taken."""

    def __post_init__(self) -> None:
        require(self.weight_sync_interval > 0, "weight_sync_interval", "> 0", self.weight_sync_interval)
        require(self.weight_sync_retries >= 0, "weight_sync_retries", ">= 0", self.weight_sync_retries)
        require(
            self.weight_sync_check_tolerance > 0,
            "weight_sync_check_tolerance",
            "> 0",
            self.weight_sync_check_tolerance,
        )

    def build(
        self, engine: RolloutEngine, placement: Placement, items: Sequence[PromptItem], tokenizer
    ) -> WeightSync:
        """The run's weight sync to `engine`, checked on a probe prompt of `items` when the engine
        keeps its own copy of the weights and the check is on."""
        check = None
        if self.weight_sync_check and not engine.shares_policy_weights:
            check = SyncCheck(probe_ids(items, tokenizer), tolerance=self.weight_sync_check_tolerance)
        return WeightSync(
            engine,
            placement,
            interval=self.weight_sync_interval,
            retries=self.weight_sync_retries,
            check=check,
        )


class WeightSync:
    """Sends the placed policy's weights to `engine` every `interval` steps.

    Args:
        interval: steps between syncs (`weight_sync_interval`).
        retries: tries after the first failed one before giving up (`weight_sync_retries`).
        check: the check of the engine's weights after each sync, or None.
    """

    def __init__(
        self,
        engine: RolloutEngine,
        placement: Placement,
        *,
        interval: int,
        retries: int,
        check: SyncCheck | None = None,
    ) -> None:
        self.engine, self.placement = engine, placement
        self.interval, self.retries, self.check = interval, retries, check

    def after_step(self, step: int) -> dict[str, float]:
        """After step `step`: send its weights when a sync is due, then check them (when on);
        the check's metrics. Raises the last WeightSyncError when every try failed."""
        if step % self.interval != 0:
            return {}
        with phase("sync"):
            self._send_with_retries(step)
        if self.check is None:
            return {}
        with phase("sync_check"):
            return self.check(self.engine, self.placement, step=step)

    def send(self, version: int) -> None:
        """Send the weights now, as policy version `version`."""
        self.engine.update_weights(self.placement.rollout_weights(self.engine), version)

    def _send_with_retries(self, version: int) -> None:
        for attempt in range(self.retries + 1):
            try:
                self.send(version)
                return
            except WeightSyncError as error:
                logger.warning(
                    "weight sync to version %d failed (try %d of %d): %s",
                    version,
                    attempt + 1,
                    self.retries + 1,
                    error,
                )
                if attempt == self.retries:
                    raise
