"""The server's worker threads, kept apart so that no class of request can take another's.

- `engine` (one thread): generation batches and everything else that touches the engine (weight
  loads, sleep, wake-up), one at a time under the batcher's lock.
- `requests` (`request_threads`): the CPU work of reading and answering a request (parsing large
  JSON bodies, rendering chat templates, tokenising prompts, decoding completions, reading
  safetensors bodies and files, checking weights), so the event loop keeps answering /health and
  every other request meanwhile.
- `bodies` (one thread): parsing JSON bodies over a megabyte, one at a time, so that a few large
  bodies neither hold the request threads nor, contending for the GIL together, the event loop.

Joining a trainer's weight-transfer group waits on the network in a daemon thread of its own
(`CollectiveReceiver`). None of these is the event loop's default executor, so `asyncio.to_thread`
elsewhere cannot starve generation, and every thread is a daemon: work that overstays never keeps
the process from exiting on SIGTERM.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from concurrent.futures import Executor
from typing import Any, TypeVar

from grpoflow.threads import DaemonPool

T = TypeVar("T")


class Pools:
    """The engine's, the requests' and the large bodies' worker threads of one server."""

    def __init__(self, request_threads: int = 4) -> None:
        self.engine = DaemonPool(1, "grpoflow-engine")
        self.requests = DaemonPool(request_threads, "grpoflow-request")
        self.bodies = DaemonPool(1, "grpoflow-body")

    def shutdown(self) -> None:
        """Stop taking work; running calls finish on their own."""
        self.engine.shutdown()
        self.requests.shutdown()
        self.bodies.shutdown()


async def run_in(pool: Executor, function: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """`function(*args, **kwargs)` in `pool`, awaited from the event loop."""
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(pool, functools.partial(function, *args, **kwargs))
