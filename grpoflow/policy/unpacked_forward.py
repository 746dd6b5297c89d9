"""A transformers forward of rows that are known to hold one sequence each, without transformers'
check for packed sequences.

Given no attention mask, transformers' mask builder looks for packed sequences in the position ids
(`masking_utils.find_packed_sequence_indices`) and reads its answer on the host: each forward of
an unpadded micro-batch then waits for the device to finish all the work queued before it. Rows
whose positions are the model's own `0..n-1` hold one sequence each, so the answer is known: no
packed sequences. Inside `unpacked_positions()` the check gives that answer without reading the
device. The padding-free path (`algo.packing`), whose position ids restart, keeps the check. The
block replaces a module attribute: a forward on another thread meanwhile would see the answer too
(the learner's forwards run on one thread; generation with a cache skips the check).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager

import torch

CHECK = "find_packed_sequence_indices"
"""transformers.masking_utils' check for packed sequences."""


def _one_sequence_a_row(position_ids: torch.Tensor) -> None:
    """The check's answer for rows of one sequence each: none packed."""
    return None


@contextmanager
def unpacked_positions() -> Iterator[None]:
    """Within the block, transformers takes every forward's rows as one sequence each (only for
    forwards given neither an attention mask nor position ids: the model's own `0..n-1`)."""
    masking = sys.modules.get("transformers.masking_utils")
    original = getattr(masking, CHECK, None)
    if original is None:  # a transformers without the check: nothing to skip
        yield
        return
    setattr(masking, CHECK, _one_sequence_a_row)
    try:
        yield
    finally:
        setattr(masking, CHECK, original)
