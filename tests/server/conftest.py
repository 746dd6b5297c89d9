"""A live `grpoflow serve` on the tiny model: uvicorn in a thread on a free port."""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from grpoflow.server import ServeConfig, build_app, build_service  # noqa: E402
from grpoflow.server.service import Service  # noqa: E402

CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'][0] }}:{{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}a:{% endif %}"
)
"""A chat template the character tokenizer can spell."""


@dataclass
class LiveServer:
    url: str
    service: Service
    server: object
    thread: threading.Thread

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


def tiny_service(**overrides) -> Service:
    return build_service(ServeConfig(model="tiny", device="cpu", **overrides))


def start_server(service: Service) -> LiveServer:
    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(build_app(service), log_level="warning", lifespan="on")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the test server did not start")
        time.sleep(0.02)
    return LiveServer(f"http://127.0.0.1:{port}", service, server, thread)


@pytest.fixture(scope="module")
def live():
    """A server shared by a module's tests; tests that change its weights use their own."""
    server = start_server(tiny_service())
    yield server
    server.stop()


@pytest.fixture
def fresh():
    """A server of its own, for tests that change weights or pause generation."""
    server = start_server(tiny_service())
    yield server
    server.stop()


@pytest.fixture(scope="session")
def serve_live():
    """Starts a live server for a given Service (stop it with `.stop()`)."""
    return start_server


@pytest.fixture(scope="session")
def make_service():
    """Builds a tiny-model service with the given ServeConfig settings."""
    return tiny_service


@pytest.fixture
def chat_template() -> str:
    return CHAT_TEMPLATE


@pytest.fixture
def client(live):
    with httpx.Client(base_url=live.url, timeout=60) as session:
        yield session
