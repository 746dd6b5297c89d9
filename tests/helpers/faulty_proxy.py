"""A proxy in front of a real server that misbehaves on cue: it drops connections, answers 503,
sends HTML, drips its answer one byte at a time, or corrupts completions, so the trainer's client
can be tested against every way a rollout server fails."""

from __future__ import annotations

import json
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx

FAULTS = ("drop", "503", "html", "drip", "nan_logprobs", "huge_token_ids", "no_choices")


class FaultyProxy:
    """Forwards every request to `upstream`; `fail(path, fault, times)` makes the next `times`
    requests to `path` fail that way (times=None: until `heal(path)`)."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream.rstrip("/")
        self.faults: dict[str, list[str]] = defaultdict(list)
        self.sticky: dict[str, str] = {}
        self.seen: dict[str, int] = defaultdict(int)
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"

    def fail(self, path: str, fault: str, times: int | None = 1) -> None:
        assert fault in FAULTS, fault
        with self._lock:
            if times is None:
                self.sticky[path] = fault
            else:
                self.faults[path].extend([fault] * times)

    def heal(self, path: str) -> None:
        with self._lock:
            self.sticky.pop(path, None)
            self.faults.pop(path, None)

    def next_fault(self, path: str) -> str | None:
        with self._lock:
            self.seen[path] += 1
            if self.faults.get(path):
                return self.faults[path].pop(0)
            return self.sticky.get(path)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def _handler(proxy: FaultyProxy) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:
            return None

        def do_GET(self) -> None:
            self._forward("GET")

        def do_POST(self) -> None:
            self._forward("POST")

        def _forward(self, method: str) -> None:
            path = self.path.split("?")[0]
            body = self.rfile.read(int(self.headers.get("content-length") or 0))
            fault = proxy.next_fault(path)
            if fault == "drop":
                self.close_connection = True
                self.connection.close()
                return
            if fault == "503":
                return self._answer(503, b'{"error": {"message": "restarting"}}')
            if fault == "html":
                return self._answer(200, b"<html><body>502 Bad Gateway</body></html>", "text/html")
            headers = {
                k: v for k, v in self.headers.items() if k.lower() in ("content-type", "authorization")
            }
            upstream = httpx.request(
                method, proxy.upstream + self.path, content=body, headers=headers, timeout=120
            )
            content = _corrupt(fault, upstream.content) if fault in _CORRUPTIONS else upstream.content
            if fault == "drip":
                return self._answer(upstream.status_code, content, drip_s=0.5)
            self._answer(upstream.status_code, content)

        def _answer(
            self, status: int, content: bytes, kind: str = "application/json", drip_s: float = 0.0
        ) -> None:
            self.send_response(status)
            self.send_header("content-type", kind)
            self.send_header("content-length", str(len(content)))
            self.end_headers()
            if not drip_s:
                self.wfile.write(content)
                return
            for byte in content:
                try:
                    self.wfile.write(bytes([byte]))
                    self.wfile.flush()
                except OSError:  # the client gave up
                    return
                time.sleep(drip_s)

    return Handler


def _choices(edit: Callable[[dict], None]) -> Callable[[bytes], bytes]:
    def corrupt(content: bytes) -> bytes:
        answer = json.loads(content)
        for choice in answer.get("choices", []):
            edit(choice)
        return json.dumps(answer).encode()

    return corrupt


def _no_choices(content: bytes) -> bytes:
    answer = json.loads(content)
    answer.pop("choices", None)
    return json.dumps(answer).encode()


_CORRUPTIONS: dict[str, Callable[[bytes], bytes]] = {
    "nan_logprobs": _choices(
        lambda c: c["logprobs"].__setitem__("token_logprobs", [float("nan")] * len(c["token_ids"]))
    ),
    "huge_token_ids": _choices(lambda c: c.__setitem__("token_ids", [10**12] * len(c["token_ids"]))),
    "no_choices": _no_choices,
}


def _corrupt(fault: str, content: bytes) -> bytes:
    return _CORRUPTIONS[fault](content)
