"""Moving the trainer's weights to rollout engines, each transport's sending and receiving side,
and the HTTP client every request to a rollout server goes through (`server_client.py`).

- `collective`: a process group of its own between the trainer and the rollout servers, the
  weights broadcast in packed buckets (NCCL between GPUs, gloo otherwise). `collective.py` is the
  wire layer both sides share, `collective_sender.py` the trainer's side, `collective_receiver.py`
  a server's.
- `checkpoint`: the trainer writes the weights as safetensors to a directory the servers can read
  and asks each to reload them (`checkpoint_sender.py`); a server reads and checks such files, or a
  safetensors body sent over HTTP (`checkpoint_receiver.py`).
- `in_process`: the weights handed by reference to a vLLM engine in the same process
  (`in_process.py`), and the vLLM worker methods that load them.

No module here knows the server, the engines or the run: a sender is given a `request` callable
(a `ServerClient`'s, for the remote engine), a receiver the model's shapes, a way to load tensors
and a way to hold generation.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

WEIGHT_TRANSFERS = ("auto", "collective", "checkpoint")
"""How RemoteEngine sends weights: `collective` (a process group with every server), `checkpoint`
(a safetensors directory each server reloads), `auto` (collective when every server offers it)."""


class WeightSyncError(RuntimeError):
    """A weight update failed; the message names the server, the version and where it stopped."""


class ServerError(RuntimeError):
    """A rollout server failed or answered badly; the message names the server. `status`: the
    HTTP status it answered with, None when it gave no answer."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


Request = Callable[..., Any]
"""How a sender talks to the servers: `request(method, url, path, *, timeout=None, **httpx_kwargs)`
returns the answer's JSON (None for an empty body), or raises ServerError naming the server and the
HTTP status."""


class ReceiveError(Exception):
    """A receiver could not join a group or take an update. `status` is the HTTP status a server
    answers with (4xx: refused, nothing changed; 5xx: it failed on the way), `param` the request
    field at fault."""

    def __init__(self, message: str, status: int = 400, param: str | None = None) -> None:
        super().__init__(message)
        self.message, self.status, self.param = message, status, param
