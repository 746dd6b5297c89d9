"""The server's worker threads, kept apart so that no class of request can take another's.

- `engine` (one thread): generation batches and everything else that touches the engine (weight
  loads, sleep, wake-up), one at a time under the batcher's lock.
- `requests` (`request_threads`): the CPU work of reading and answering a request (parsing large
  JSON bodies, rendering chat templates, tokenising prompts, decoding completions, reading
  safetensors bodies and files, checking weights), so the event loop keeps answering /health and
  every other request meanwhile.

Joining a trainer's weight-transfer group waits on the network in a daemon thread of its own
(`CollectiveReceiver`). None of these is the event loop's default executor, so `asyncio.to_thread`
elsewhere cannot starve generation, and every thread is a daemon: work that overstays never keeps
the process from exiting on SIGTERM.
"""

from __future__ import annotations

import asyncio
import functools
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import Any, TypeVar

from grpoflow.threads import run_into

T = TypeVar("T")


class DaemonPool(Executor):
    """A fixed number of daemon worker threads taking calls from one queue."""

    def __init__(self, threads: int, name: str) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._closed = False
        for index in range(threads):
            threading.Thread(target=self._work, name=f"{name}-{index}", daemon=True).start()
        self._threads = threads

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future:
        if self._closed:
            raise RuntimeError("the pool is shut down")
        future: Future = Future()
        self._queue.put((future, fn, args, kwargs))
        return future

    def shutdown(self, wait: bool = False, *, cancel_futures: bool = True) -> None:
        """Stop the workers once they finish what they run; queued calls are cancelled."""
        self._closed = True
        while cancel_futures:
            try:
                future, *_ = self._queue.get_nowait()
            except queue.Empty:
                break
            future.cancel()
        for _ in range(self._threads):
            self._queue.put(None)

    def _work(self) -> None:
        while (item := self._queue.get()) is not None:
            future, fn, args, kwargs = item
            run_into(future, fn, *args, **kwargs)


class Pools:
    """The engine's and the requests' worker threads of one server."""

    def __init__(self, request_threads: int = 4) -> None:
        self.engine = DaemonPool(1, "grpoflow-engine")
        self.requests = DaemonPool(request_threads, "grpoflow-request")

    def shutdown(self) -> None:
        """Stop taking work; running calls finish on their own."""
        self.engine.shutdown()
        self.requests.shutdown()


async def run_in(pool: Executor, function: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """`function(*args, **kwargs)` in `pool`, awaited from the event loop."""
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(pool, functools.partial(function, *args, **kwargs))
