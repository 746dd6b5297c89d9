"""Freed heap memory goes back to the system once the server is quiet (CPU)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import httpx
import pytest

from grpoflow.server.memory import _malloc_trim, trim_heap

pytestmark = pytest.mark.skipif(_malloc_trim() is None, reason="needs glibc's malloc_trim")


def rss_mib() -> float:
    for line in Path(f"/proc/{os.getpid()}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def test_trim_heap_gives_freed_blocks_below_a_live_one_back():
    blocks = [bytes(2000) for _ in range(30000)]  # about 60 MiB through malloc
    pinned = bytes(2000)  # above them on the heap: the heap cannot shrink from its top
    del blocks
    held = rss_mib()
    assert trim_heap()
    assert held - rss_mib() > 30
    assert pinned


def test_a_server_trims_once_quiet_after_work_and_not_while_idle(make_service, serve_live):
    server = serve_live(make_service(trim_quiet_s=0.1))
    try:
        trimmer = server.service.trimmer
        time.sleep(0.5)
        assert trimmer.trims == 0  # no work yet: nothing to give back
        body = {"prompt": [1, 2, 3], "n": 64, "max_tokens": 16, "ignore_eos": True}
        assert httpx.post(server.url + "/v1/completions", json=body, timeout=60).status_code == 200
        deadline = time.monotonic() + 5
        while trimmer.trims == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert trimmer.trims == 1
        time.sleep(0.5)
        assert trimmer.trims == 1  # quiet since: no second trim
    finally:
        server.stop()
