"""Asynchronous generation: the next step's rollout runs in a background thread while the trainer
updates on this one.

With `async_generate`, a step takes the batch that was generated during the previous step's
update, starts generating the next batch (the engine still holds the weights of the previous
sync), runs its own update, then waits for that generation to finish before it pushes the new
weights, so weights never change under a running generation. Each batch is therefore sampled by
the policy one sync older than the one it trains (staleness 1), which the importance-sampling
correction (`algo.sampling_correction`) accounts for. Only engines with their own copy of the
weights (rollout servers) can generate while the policy trains.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from grpoflow.phases import PhaseTimer, charge_background, phase
from grpoflow.rollout.groups import ScoredGroups
from grpoflow.rollout.scoring import SampledGroups
from grpoflow.rollout.source import GroupSource

T = TypeVar("T")

logger = logging.getLogger("grpoflow")


@dataclass(slots=True)
class Prefetched(Generic[T]):
    """A batch generated ahead, with what it cost and where the prompt order stood before it."""

    value: T
    """What the producer returned (the trainer's scored groups)."""
    seconds: dict[str, float]
    """Seconds per phase spent producing it, in the background."""
    resume_state: Any
    """The sampling state before the batch took its prompts: a checkpoint written while the
    batch is pending restores this, so a resumed run generates the batch again."""


class RolloutPrefetcher(Generic[T]):
    """One rollout in flight at a time, on one background thread."""

    def __init__(self) -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grpoflow-rollout")
        self._pending: Future[Prefetched[T]] | None = None
        self._resume_state: Any = None

    @property
    def pending(self) -> bool:
        """A batch was launched and not yet taken."""
        return self._pending is not None

    @property
    def resume_state(self) -> Any:
        """The sampling state before the pending batch (None when nothing is pending)."""
        return self._resume_state if self.pending else None

    def launch(self, produce: Callable[[], tuple[T, dict[str, float]]], resume_state: Any) -> None:
        """Start `produce()` (returning the batch and its seconds per phase) in the background."""
        if self._pending is not None:
            raise RuntimeError("a prefetched rollout is still pending: take it before launching another")

        def run() -> Prefetched[T]:
            value, seconds = produce()
            return Prefetched(value, seconds, resume_state)

        self._resume_state = resume_state
        self._pending = self._executor.submit(run)

    def wait(self) -> None:
        """Block until the pending rollout has finished (its errors surface in `take`)."""
        if self._pending is not None:
            self._pending.exception()

    def take(self) -> Prefetched[T]:
        """The pending batch, waiting for it; re-raises the error the rollout raised."""
        if self._pending is None:
            raise RuntimeError("no prefetched rollout is pending")
        future, self._pending = self._pending, None
        return future.result()

    def take_fresh(
        self, step: int, max_staleness: int, oldest_version: Callable[[T], int]
    ) -> tuple[Prefetched[T], int] | None:
        """The pending batch and its staleness (policy versions between the oldest weights that
        sampled it, `oldest_version(batch)`, and `step`), or None with a warning when it is older
        than `max_staleness` (the caller generates a new one)."""
        prefetched = self.take()
        staleness = step - oldest_version(prefetched.value)
        if staleness <= max_staleness:
            return prefetched, staleness
        logger.warning(
            "step %d: the prefetched batch is %d policy versions old (max_staleness %d); generating a new one",
            step,
            staleness,
            max_staleness,
        )
        return None

    def close(self) -> None:
        """Wait for a running rollout and stop the thread; a pending batch is dropped."""
        self.wait()
        self._pending = None
        self._executor.shutdown(wait=True)


class PrefetchedGroups(GroupSource):
    """Sampled groups made one step ahead, in the background, while the trainer updates
    (`async_generate`); a batch older than `max_staleness` policy versions is made again."""

    makes_ahead = True

    def __init__(self, source: SampledGroups, max_staleness: int) -> None:
        self.source, self.max_staleness = source, max_staleness
        self.reward_names, self.reward_weights = source.reward_names, source.reward_weights
        self.prefetcher: RolloutPrefetcher[ScoredGroups] = RolloutPrefetcher()

    def next(self, step: int) -> ScoredGroups:
        if self.prefetcher.pending:
            with phase("rollout_wait"):
                fresh = self.prefetcher.take_fresh(step, self.max_staleness, ScoredGroups.oldest_version)
            if fresh is not None:
                prefetched, staleness = fresh
                charge_background(prefetched.seconds)
                prefetched.value.staleness = staleness
                return prefetched.value
        return self.source.next(step)

    def ahead(self, step: int) -> None:
        """Start making the next step's groups (their seconds are logged as `time/background/...`:
        they overlap the update)."""

        def produce() -> tuple[ScoredGroups, dict[str, float]]:
            timer = PhaseTimer(synchronize=False)
            with timer.active():
                return self.source.make(), dict(timer.seconds)

        with phase("rollout_launch"):
            self.prefetcher.launch(produce, self.source.state_dict())

    def settle(self) -> None:
        with phase("rollout_wait"):
            self.prefetcher.wait()  # weights never change under a running generation

    def state_dict(self) -> dict:
        # A batch made ahead is not in the checkpoint: resuming makes it again.
        return self.prefetcher.resume_state or self.source.state_dict()

    def load_state_dict(self, state: dict) -> bool:
        return self.source.load_state_dict(state)

    def close(self) -> None:
        self.prefetcher.close()
        self.source.close()
