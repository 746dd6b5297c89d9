"""Moving the trainer's weights to rollout engines that keep their own copy.

`collective` builds a process group of its own between the trainer and rollout servers and
broadcasts the weights in packed buckets (NCCL between GPUs, gloo otherwise); the server side lives
in `grpoflow.server.collective`, the trainer side in `grpoflow.engines.remote`.
"""

from __future__ import annotations

WEIGHT_TRANSFERS = ("auto", "collective", "checkpoint")
"""How RemoteEngine sends weights: `collective` (a process group with every server), `checkpoint`
(a safetensors directory each server reloads), `auto` (collective when every server offers it)."""


class WeightSyncError(RuntimeError):
    """A weight update failed; the message names the server, the version and where it stopped."""
