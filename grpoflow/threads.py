"""Work in a daemon thread: user code (a reward, a tool, an environment) that may hang past its
timeout must neither block later work nor the interpreter's exit; a thread cannot be killed."""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable
from typing import Any


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
