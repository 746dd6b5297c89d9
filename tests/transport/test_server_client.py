"""The remote engine's pieces that need no server: the HTTP client, the server URLs, the prompt
split and the choice of weight transfer."""

from __future__ import annotations

import pytest

pytest.importorskip("httpx")

from grpoflow.remote.capabilities import ServerOffer, choose_transfer  # noqa: E402
from grpoflow.remote.engine import RemoteEngine, split_evenly  # noqa: E402
from grpoflow.transport import ServerError  # noqa: E402
from grpoflow.transport.server_client import ServerClient, server_urls  # noqa: E402

NOWHERE = "http://127.0.0.1:1"
"""A URL nothing listens on."""


def offer(url: str, *, collective: bool) -> ServerOffer:
    return ServerOffer(url, "m", "grpoflow_reload_weights", collective, "cpu" if collective else None)


def test_urls_and_splits():
    assert server_urls("a:1, http://b:2/", None, 8000) == ["http://a:1", "http://b:2"]
    assert server_urls(None, "h", 9) == ["http://h:9"]
    assert [list(part) for part in split_evenly(5, 3)] == [[0, 1], [2, 3], [4]]
    assert [list(part) for part in split_evenly(1, 2)] == [[0], []]
    with pytest.raises(ValueError, match="names no server"):
        server_urls(" , ", None, 1)


def test_a_server_that_never_comes_up_is_named():
    with pytest.raises(ServerError, match=r"127\.0\.0\.1:1 not healthy after 0s"):
        RemoteEngine([NOWHERE], startup_timeout=0.5)


def test_a_failed_request_names_the_server_and_the_request():
    client = ServerClient([NOWHERE], request_timeout=5)
    try:
        with pytest.raises(ServerError, match=r"vLLM server http://127\.0\.0\.1:1: GET /v1/models failed"):
            client.request("GET", NOWHERE, "/v1/models")
        assert client.map(lambda url, n: (url, n), [7]) == [(NOWHERE, 7)]
    finally:
        client.close()


def test_the_transfer_is_collective_only_where_every_server_offers_it(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    both = [offer("http://a", collective=True), offer("http://b", collective=True)]
    mixed = [offer("http://a", collective=True), offer("http://b", collective=False)]
    assert choose_transfer("auto", both, exclusive_servers=False) == "collective"
    assert choose_transfer("auto", mixed, exclusive_servers=False) == "checkpoint"
    assert choose_transfer("checkpoint", both, exclusive_servers=False) == "checkpoint"
    with pytest.raises(ValueError, match=r"server\(s\) http://b offer no collective weight transfer"):
        choose_transfer("collective", mixed, exclusive_servers=False)
    monkeypatch.setenv("WORLD_SIZE", "2")  # under torchrun, servers shared by the trainers
    assert choose_transfer("auto", both, exclusive_servers=False) == "checkpoint"
    assert choose_transfer("auto", both, exclusive_servers=True) == "collective"
    with pytest.raises(ValueError, match="works from a single trainer process"):
        choose_transfer("collective", both, exclusive_servers=False)
