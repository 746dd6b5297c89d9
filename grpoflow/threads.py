"""Work in daemon threads: user code (a reward, a tool, an environment) that may hang past its
timeout must neither block later work nor the interpreter's exit; a thread cannot be killed.
`DaemonPool` bounds how many such threads there are: a call that hangs holds its thread, and the
calls after it wait for a free one (and give up at their own timeout), so a run whose environment
hangs keeps a flat thread count."""

from __future__ import annotations

import concurrent.futures
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import Any, TypeVar

T = TypeVar("T")


def run_into(future: concurrent.futures.Future, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
    """Run `fn(*args, **kwargs)` into `future` (its result or its error), unless it was cancelled."""
    if not future.set_running_or_notify_cancel():
        return
    try:
        future.set_result(fn(*args, **kwargs))
    except BaseException as error:
        future.set_exception(error)


def in_daemon_thread(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> concurrent.futures.Future:
    """Start `fn(*args, **kwargs)` in a daemon thread of its own; its future."""
    future: concurrent.futures.Future = concurrent.futures.Future()
    name = f"grpoflow-{getattr(fn, '__name__', 'work')}"
    threading.Thread(target=run_into, args=(future, fn, *args), kwargs=kwargs, name=name, daemon=True).start()
    return future


class DaemonPool(Executor):
    """At most `threads` daemon worker threads taking calls from one queue, started as the calls
    need them. A caller that stops waiting cancels its future: a call still queued never runs."""

    def __init__(self, threads: int, name: str) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._closed = False
        self._max, self._name = threads, name
        self._started = self._queued = self._running = 0

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future:
        if self._closed:
            raise RuntimeError("the pool is shut down")
        future: Future = Future()
        with self._lock:
            self._queued += 1
            grow = self._started < self._max and self._queued > self._started - self._running
            self._started += grow
            index = self._started
        self._queue.put((future, fn, args, kwargs))
        if grow:  # more calls wait than workers are free to take them
            threading.Thread(target=self._work, name=f"{self._name}-{index}", daemon=True).start()
        return future

    def shutdown(self, wait: bool = False, *, cancel_futures: bool = True) -> None:
        """Stop the workers once they finish what they run; queued calls are cancelled."""
        self._closed = True
        while cancel_futures:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                item[0].cancel()
        with self._lock:
            started = self._started
        for _ in range(started):
            self._queue.put(None)

    @property
    def num_threads(self) -> int:
        """Workers started so far (never more than `threads`)."""
        return self._started

    def _work(self) -> None:
        while (item := self._queue.get()) is not None:
            with self._lock:
                self._queued, self._running = self._queued - 1, self._running + 1
            future, fn, args, kwargs = item
            try:
                run_into(future, fn, *args, **kwargs)
            finally:
                # An idle worker must not keep its last call's arguments and result alive (a
                # large request body would stay in memory until the next call).
                del item, future, fn, args, kwargs
                with self._lock:
                    self._running -= 1
