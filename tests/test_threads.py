"""grpoflow.threads (CPU): a DaemonPool's idle workers hold nothing of the calls they ran."""

from __future__ import annotations

import gc
import time
import weakref

from grpoflow.threads import DaemonPool


class Payload:
    """Stands for a large request body: something only the call should keep alive."""


def test_an_idle_worker_keeps_no_argument_or_result_of_its_last_call():
    pool = DaemonPool(2, "test-idle")
    try:
        argument = Payload()
        result = pool.submit(lambda payload: (payload, Payload())[1], argument).result(timeout=10)
        watched = weakref.ref(argument), weakref.ref(result)
        del argument, result
        deadline = time.monotonic() + 5  # the worker lets go just after it answers
        while any(ref() is not None for ref in watched) and time.monotonic() < deadline:
            gc.collect()
            time.sleep(0.01)
        assert [ref() for ref in watched] == [None, None]
    finally:
        pool.shutdown()
