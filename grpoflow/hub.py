"""The Hugging Face hub seen from a machine that may be offline: a name that is not local is looked
up on the hub only when its host answers, so an offline run fails in seconds with the fix instead
of after a minute of retries."""

from __future__ import annotations

import os
import socket
from urllib.parse import urlparse

PROBE_SECONDS = 3.0
"""How long to wait for the hub's host to accept a connection."""
OFFLINE_VARIABLES = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE")


def endpoint() -> str:
    """The hub's address (HF_ENDPOINT, else huggingface.co)."""
    return os.environ.get("HF_ENDPOINT", "https://huggingface.co")


def offline() -> bool:
    """Whether the user asked for offline mode (the libraries then read their local cache)."""
    return any(os.environ.get(name, "").upper() in {"1", "ON", "YES", "TRUE"} for name in OFFLINE_VARIABLES)


def unreachable() -> bool:
    """True when the hub's host does not accept a connection and offline mode is not set."""
    if offline():
        return False
    url = urlparse(endpoint())
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        socket.create_connection((url.hostname, port), timeout=PROBE_SECONDS).close()
    except OSError:
        return True
    return False


def unreachable_message(what: str) -> str:
    """`what` (e.g. "model 'org/name'") is not local and the hub cannot be reached: the fix."""
    return (
        f"{what} is not local, and the hub ({endpoint()}) cannot be reached to look for it. Check the "
        "name or the network; for a copy in the local hub cache set HF_HUB_OFFLINE=1"
    )
