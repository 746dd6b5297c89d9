"""Where a step makes the host wait for the GPU: `sync_sites()` turns on torch's sync debug mode
(`torch.cuda.set_sync_debug_mode("warn")`), which warns at every synchronizing CUDA operation
(`.item()`, `.tolist()`, `nonzero`, a copy to the host, a copy from pageable host memory), and
counts the warnings by the innermost grpoflow frame that led to them. Each such wait drains the
GPU's queue, so what the host does next is no longer hidden behind kernels already queued.

    with sync_sites() as counts:
        trainer.step()
    print_sites(counts)
"""

from __future__ import annotations

import contextlib
import traceback
import warnings
from collections import Counter
from collections.abc import Iterator

import torch

PACKAGE = "/grpoflow/"


def _site() -> str:
    for frame in reversed(traceback.extract_stack()[:-2]):
        if PACKAGE in frame.filename and "/benchmarks/" not in frame.filename:
            return f"{frame.filename.rsplit(PACKAGE, 1)[-1]}:{frame.lineno} {frame.name}"
    return "(outside grpoflow)"


@contextlib.contextmanager
def sync_sites() -> Iterator[Counter]:
    """Counts of synchronizing operations by grpoflow call site while the block runs (CUDA only;
    empty elsewhere)."""
    counts: Counter = Counter()
    if not torch.cuda.is_available():
        yield counts
        return
    previous_mode = torch.cuda.get_sync_debug_mode()
    previous_show = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        if "synchronizing" in str(message):
            counts[_site()] += 1
        else:
            previous_show(message, category, filename, lineno, file, line)

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = show
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield counts
        finally:
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode(previous_mode)
            warnings.showwarning = previous_show


def print_sites(counts: Counter, rows: int = 20) -> None:
    print(f"synchronizing operations: {sum(counts.values())} (by grpoflow call site)")
    for site, count in counts.most_common(rows):
        print(f"{count:6d}  {site}")
