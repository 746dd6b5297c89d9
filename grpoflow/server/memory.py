"""Giving freed heap memory back to the system once the server goes quiet.

A burst of large requests (a call of a thousand sequences, bodies of tens of megabytes) leaves
glibc's heaps holding freed memory: the process stays tens of megabytes larger after the burst
than before it, and a long-running server drifts upward burst after burst. `QuietTrimmer` watches
the server's work and, once it has been quiet for `quiet_s` after some, asks glibc to return what
is free (`malloc_trim`), in the engine's thread so that it never runs beside generation. Elsewhere
than glibc it does nothing.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import functools
import logging
from collections.abc import Callable
from concurrent.futures import Executor

from grpoflow.server.pools import run_in

logger = logging.getLogger("grpoflow.serve")


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):  # not glibc
        return None


def trim_heap() -> bool:
    """Return the heaps' free memory to the system; False where the C library cannot."""
    trim = _malloc_trim()
    return bool(trim is not None and trim(0))


class QuietTrimmer:
    """Trims the heap once the server has been quiet for `quiet_s` after doing work.

    `work` gives a number that moves whenever work was done (engine calls, large bodies read);
    `busy` says whether work is under way now. Checked every `quiet_s` on the event loop; the trim
    itself runs in `executor` (the engine's thread)."""

    def __init__(
        self, work: Callable[[], int], busy: Callable[[], bool], executor: Executor, quiet_s: float = 1.0
    ) -> None:
        self.work, self.busy, self.executor, self.quiet_s = work, busy, executor, quiet_s
        self.trims = 0
        self._trimmed_at = work()
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        if _malloc_trim() is not None and self.quiet_s > 0:
            self._task = asyncio.get_running_loop().create_task(self._watch())

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()

    async def _watch(self) -> None:
        seen = self.work()
        while True:
            await asyncio.sleep(self.quiet_s)
            now = self.work()
            quiet = now == seen and not self.busy()
            if quiet and now != self._trimmed_at:
                self._trimmed_at = now
                await run_in(self.executor, trim_heap)
                self.trims += 1
            seen = now
