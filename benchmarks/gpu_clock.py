"""Waiting for a device's queued work before a benchmark reads the clock."""

from __future__ import annotations

import torch


def synchronize(device: torch.device) -> None:
    """Wait until the work queued on `device` has run (nothing to wait for on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
