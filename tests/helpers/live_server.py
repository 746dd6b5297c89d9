"""A live `grpoflow serve` on the tiny model: uvicorn in a thread of this process, on a free port.

Needs FastAPI, uvicorn and httpx; test modules importing this skip without them first.
"""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from grpoflow.server.service import Service


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
    from grpoflow.server import ServeConfig, build_service

    return build_service(ServeConfig(model="tiny", device="cpu", **overrides))


def start_server(service: Service) -> LiveServer:
    import uvicorn

    from grpoflow.server import build_app
    from grpoflow.server.connections import header_deadline

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(
        build_app(service),
        log_level="warning",
        lifespan="on",
        http=header_deadline(service.config.header_timeout_s),
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the test server did not start")
        time.sleep(0.02)
    return LiveServer(f"http://127.0.0.1:{port}", service, server, thread)
