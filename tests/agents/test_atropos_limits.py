"""The Atropos client against a misbehaving trajectory API: a raw HTTP server in the test that drips
its answer a byte at a time, or sends a batch without end, is cut off at the client's limits."""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterator

import pytest

pytest.importorskip("httpx")

from grpoflow.agents.atropos_client import AtroposClient, AtroposConfig  # noqa: E402

LOGGER = "grpoflow.agents.atropos_client"
SMALL_BATCH = {"batch": [{"tokens": [[1, 2, 3]], "masks": [[-100, 2, 3]], "scores": [1.0]}]}

Answer = Callable[[socket.socket], None]


@contextlib.contextmanager
def raw_api(*answers: Answer) -> Iterator[str]:
    """A server on a free local port whose n-th connection `answers[n]` writes to; its URL."""
    listener = socket.create_server(("127.0.0.1", 0))

    def talk(connection: socket.socket, answer: Answer) -> None:
        with connection, contextlib.suppress(OSError):
            connection.recv(65536)  # the request: a GET, all in one segment
            answer(connection)

    def serve() -> None:
        for answer in answers:
            try:
                connection, _ = listener.accept()
            except OSError:
                return
            threading.Thread(target=talk, args=(connection, answer), daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        listener.close()


def drip(head: bytes, rest: bytes, every: float = 0.05) -> Answer:
    """Send `head` at once, then `rest` a byte every `every` seconds."""

    def answer(connection: socket.socket) -> None:
        connection.sendall(head)
        for byte in rest:
            connection.sendall(bytes([byte]))
            time.sleep(every)

    return answer


def reply(body: dict, headers: str = "") -> Answer:
    """A whole JSON answer at once."""
    data = json.dumps(body).encode()
    head = f"HTTP/1.1 200 OK\r\nContent-Length: {len(data)}\r\nConnection: close\r\n{headers}\r\n"
    return lambda connection: connection.sendall(head.encode() + data)


def endless(seconds: float = 3.0) -> Answer:
    """A batch whose tokens never end (no Content-Length: its body runs until the connection closes)."""

    def answer(connection: socket.socket) -> None:
        connection.sendall(b'HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n{"batch": [{"tokens": [[')
        stop = time.monotonic() + seconds
        while time.monotonic() < stop:
            connection.sendall(b"1, " * 4096)

    return answer


def declared_huge(connection: socket.socket) -> None:
    """An answer that says it is 10 GB long, then holds."""
    connection.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 10000000000\r\n\r\n")
    time.sleep(3.0)


OK_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 80\r\n\r\n"


@pytest.mark.parametrize(
    ("head", "rest"),
    [
        (OK_HEAD, b" " * 78 + b"{}"),  # the body a byte at a time
        (b"", b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}"),  # the headers too
    ],
    ids=["body", "headers"],
)
def test_a_dripping_api_is_cut_off_at_atropos_timeout_in_all(head, rest):
    """Each byte comes well within the timeout, but the answer as a whole does not."""
    with raw_api(drip(head, rest)) as url:
        config = AtroposConfig(atropos_url=url, atropos_timeout=0.5)
        started = time.monotonic()
        with AtroposClient(config) as client, pytest.raises(TimeoutError) as error:
            client.status()
        elapsed = time.monotonic() - started
    assert elapsed < 1.5, elapsed
    assert "atropos_timeout=0.5" in str(error.value) and "/status" in str(error.value)


@pytest.mark.parametrize("oversized", [endless(), declared_huge], ids=["streamed", "declared"])
def test_a_batch_past_atropos_max_batch_bytes_is_skipped_and_polling_goes_on(oversized, caplog):
    with raw_api(oversized, reply(SMALL_BATCH)) as url:
        config = AtroposConfig(atropos_url=url, atropos_timeout=10, atropos_max_batch_bytes=65536)
        with AtroposClient(config) as client, caplog.at_level(logging.WARNING, logger=LOGGER):
            started = time.monotonic()
            assert client.poll_batch() is None
            elapsed = time.monotonic() - started
            (group,) = client.poll_batch()
    assert elapsed < 1.0, elapsed  # stopped at the bound, not at the end of the answer
    assert group.token_ids == [[1, 2, 3]]
    assert "skipped a batch" in caplog.text and "atropos_max_batch_bytes=65536" in caplog.text


def test_atropos_max_batch_bytes_must_be_positive():
    with pytest.raises(ValueError, match="atropos_max_batch_bytes must be >= 1"):
        AtroposConfig(atropos_max_batch_bytes=0)
