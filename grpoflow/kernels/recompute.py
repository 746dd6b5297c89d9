"""Gradient checkpointing's recompute, told apart from the forward it repeats.

A checkpointed layer runs twice: in the forward, whose outputs the loss reads, and again in the
backward, whose outputs only carry gradients. The batch-invariant kernels matter in the first
alone; within `recomputing()` they hand over to torch's fast ops. `checkpoint_contexts` is the
`context_fn` that `torch.utils.checkpoint` enters around each (the policy loader passes it).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

_state = threading.local()


@contextlib.contextmanager
def recomputing() -> Iterator[None]:
    """Within it (on this thread), a checkpointed layer's recompute."""
    previous = is_recomputing()
    _state.on = True
    try:
        yield
    finally:
        _state.on = previous


def is_recomputing() -> bool:
    return getattr(_state, "on", False)


def checkpoint_contexts() -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
    """`torch.utils.checkpoint`'s `context_fn`: the forward as it is, the recompute in
    `recomputing()`."""
    return contextlib.nullcontext(), recomputing()
