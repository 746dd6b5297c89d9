"""Where a run's scored groups come from: one `GroupSource` per run, chosen when it is built.

The trainer asks its source for each step's groups and never learns how they were made:
`grpoflow.rollout.scoring.SampledGroups` draws prompts, plays them through a `Rollout` (one
completion per member, episodes of tools or an environment, agent programs, a user's
`rollout_func`, exact on-policy redraws) and scores them with the run's rewards;
`grpoflow.rollout.atropos.AtroposGroups` takes groups that Atropos environments sampled and scored;
`grpoflow.rollout.prefetch.PrefetchedGroups` wraps a source to make the next step's groups while
the trainer updates on this one.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch

from grpoflow.engines import RolloutEngine
from grpoflow.phases import phase
from grpoflow.policy.placement import Placement
from grpoflow.rollout.groups import ScoredGroups


class GroupSource:
    """A run's supply of scored groups, one batch per step.

    Subclasses set `reward_names` and `reward_weights` and implement `next`; the other methods
    are for sources that keep state across steps or work in the background, and do nothing here.
    """

    reward_names: Sequence[str]
    """The reward columns of the groups' `rewards`."""
    reward_weights: torch.Tensor
    """(num_rewards,) how the reward columns add up to one reward."""
    makes_ahead: bool = False
    """Its groups may be made during the previous step's update (their staleness is logged)."""

    def start(self, total_steps: int, step: int) -> None:
        """Called once before the first step the run takes (`step` steps are done of
        `total_steps`)."""

    def next(self, step: int) -> ScoredGroups:
        """The groups step `step + 1` trains on (`step` optimizer steps done), with their
        staleness set."""
        raise NotImplementedError

    def ahead(self, step: int) -> None:
        """Step `step + 1`'s groups may start being made now, in the background."""

    def settle(self) -> None:
        """Return once no background work uses the engine (before its weights change)."""

    def state_dict(self) -> dict:
        """What a checkpoint keeps to resume the source where it stood."""
        return {}

    def load_state_dict(self, state: dict) -> bool:
        """Restore `state_dict()`; False when `state` lacks part of it (an older checkpoint)."""
        return True

    def close(self) -> None:
        """Release what the source holds (threads, connections, servers it started)."""


@contextmanager
def engine_awake(engine: RolloutEngine, placement: Placement, sleep: bool = True) -> Iterator[None]:
    """The policy laid out for the engine (merged adapters, gathered shards), then the engine
    awake: its cache takes the dtype the gathered weights compute in. `sleep`: the engine releases
    its cache afterwards (sleep_level >= 1)."""
    with placement.rollout_context(engine):
        with phase("wake_up"):
            engine.wake_up()
        yield
    if sleep:
        with phase("sleep"):
            engine.sleep()
