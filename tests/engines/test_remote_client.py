"""RemoteEngine's client side, without a server."""

from __future__ import annotations

import pytest

pytest.importorskip("httpx")

from grpoflow.engines.remote import RemoteEngine, ServerError, server_urls, split_evenly  # noqa: E402


def test_urls_and_splits():
    assert server_urls("a:1, http://b:2/", None, 8000) == ["http://a:1", "http://b:2"]
    assert server_urls(None, "h", 9) == ["http://h:9"]
    assert [list(part) for part in split_evenly(5, 3)] == [[0, 1], [2, 3], [4]]
    assert [list(part) for part in split_evenly(1, 2)] == [[0], []]
    with pytest.raises(ValueError, match="names no server"):
        server_urls(" , ", None, 1)


def test_a_server_that_never_comes_up_is_named():
    with pytest.raises(ServerError, match=r"127\.0\.0\.1:1 not healthy after 0s"):
        RemoteEngine(["http://127.0.0.1:1"], startup_timeout=0.5)
