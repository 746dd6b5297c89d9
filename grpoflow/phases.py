"""Seconds per named phase of a training step, charged from wherever the work happens.

A `PhaseTimer` is made active in one thread's context (`with timer.active():`); `phase(name)`
anywhere below (a LoRA merge in the placement, an offload, the optimizer state coming back)
charges its wall-clock seconds to the active timer, and does nothing when none is active. The
timer is found through a context variable rather than passed down, so the engines, the policy's
placement and the optimizer's hooks keep their narrow interfaces; a background thread (the
prefetched rollout) runs in a context of its own and charges a timer of its own.

Phases nest, and a phase keeps only its own seconds: a nested phase's time is taken out of the
phase around it, so the phases of a step never count a second twice and add up to its total.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager, nullcontext
from contextvars import ContextVar

import torch

PROFILER_PREFIX = "phase/"
"""Each phase is also a `torch.profiler` range named `phase/<name>`, so a profile can charge
kernels to the phase that launched them (benchmarks/profile_step.py)."""
_ACTIVE: ContextVar[PhaseTimer | None] = ContextVar("grpoflow_phase_timer", default=None)


class PhaseTimer:
    """Wall-clock seconds per phase, each phase's own (nested phases taken out), and the total of
    the span it measures. `synchronize` waits for the GPU at each phase's edges, so queued kernels
    are charged to the phase that launched them (off in a background thread, where it would wait
    for the trainer's kernels too)."""

    def __init__(self, synchronize: bool = True) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        """Own seconds per phase."""
        self.background: dict[str, float] = defaultdict(float)
        """Seconds per phase spent in another thread, overlapping this span (not in `total`)."""
        self.total = 0.0
        """Seconds of the measured span (`measure`), plus any added with `add`."""
        self.synchronize = synchronize and torch.cuda.is_available()
        self._open: list[float] = []  # per open phase: the seconds of the phases nested in it

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        self._sync()
        start = time.perf_counter()
        self._open.append(0.0)
        try:
            with torch.profiler.record_function(f"{PROFILER_PREFIX}{name}"):
                yield
        finally:
            self._sync()
            elapsed = time.perf_counter() - start
            nested = self._open.pop()
            self.seconds[name] += elapsed - nested
            if self._open:
                self._open[-1] += elapsed

    @contextmanager
    def measure(self) -> Iterator[None]:
        """Add the block's wall-clock seconds to `total`."""
        self._sync()
        start = time.perf_counter()
        try:
            yield
        finally:
            self._sync()
            self.total += time.perf_counter() - start

    @contextmanager
    def active(self) -> Iterator[PhaseTimer]:
        """Within the block, `phase(...)` in this thread's context charges this timer."""
        token = _ACTIVE.set(self)
        try:
            yield self
        finally:
            _ACTIVE.reset(token)

    def add(self, name: str, seconds: float) -> None:
        """Charge `seconds` spent outside the measured span to `name`, and to the total."""
        self.seconds[name] += seconds
        self.total += seconds

    def unaccounted(self) -> float:
        """Seconds of the total in no phase (the glue between phases)."""
        return self.total - sum(self.seconds.values())

    def _sync(self) -> None:
        if self.synchronize:
            torch.cuda.synchronize()


def phase(name: str) -> AbstractContextManager[None]:
    """Charge the block's seconds to `name` on the timer active in this context, if any."""
    timer = _ACTIVE.get()
    return timer(name) if timer is not None else nullcontext()


def charge_background(seconds: Mapping[str, float]) -> None:
    """Charge seconds per phase spent in another thread, overlapping this span, to the timer
    active in this context (`time/background/...`), if any."""
    timer = _ACTIVE.get()
    if timer is not None:
        for name, value in seconds.items():
            timer.background[name] += value
