"""HTTP to the rollout servers: requests whose errors name the server, a wait for /health, and one
worker thread per server to call them all at once."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from grpoflow.transport import ServerError


def server_urls(base_url: str | None, host: str | None, port: int) -> list[str]:
    """The servers' base URLs: `base_url` split on commas, else http://host:port."""
    if base_url:
        urls = [url.strip().rstrip("/") for url in base_url.split(",") if url.strip()]
        if not urls:
            raise ValueError(f"vllm_server_base_url={base_url!r} names no server")
        return [url if "://" in url else f"http://{url}" for url in urls]
    return [f"http://{host or '127.0.0.1'}:{port}"]


class ServerClient:
    """One HTTP client for the servers at `urls` (vLLM's OpenAI-compatible server, or grpoflow serve)."""

    def __init__(self, urls: Sequence[str], *, request_timeout: float = 3600.0) -> None:
        import httpx

        if not urls:
            raise ValueError("a ServerClient needs at least one server URL")
        self.urls = list(urls)
        self.request_timeout = request_timeout
        self._client = httpx.Client(timeout=httpx.Timeout(request_timeout, connect=10.0))
        self._pool = ThreadPoolExecutor(max_workers=len(self.urls))

    def request(
        self, method: str, url: str, path: str, *, timeout: float | None = None, **kwargs: Any
    ) -> Any:
        """`method url+path` (kwargs as httpx takes them); the answer's JSON (None for an empty
        body), or ServerError naming the server, the request and the HTTP status."""
        import httpx

        timeout = timeout or self.request_timeout
        try:
            response = self._client.request(method, url + path, timeout=timeout, **kwargs)
        except httpx.TimeoutException as error:
            raise ServerError(f"vLLM server {url}: {method} {path} timed out after {timeout}s") from error
        except httpx.HTTPError as error:
            raise ServerError(
                f"vLLM server {url}: {method} {path} failed ({error}); is the server running there?"
            ) from error
        if response.status_code != 200:
            raise ServerError(
                f"vLLM server {url} answered {method} {path} with HTTP {response.status_code}: "
                f"{response.text[:1000]}"
            )
        return response.json() if response.content else None

    def map(self, function: Callable[..., Any], *arguments: Sequence) -> list:
        """`function(url, *per-server arguments)` on every server at once, in server order."""
        per_server = zip(self.urls, *arguments) if arguments else ((url,) for url in self.urls)
        return self.starmap(function, per_server)

    def starmap(self, function: Callable[..., Any], jobs: Iterable[tuple]) -> list:
        """`function(*job)` for every job at once (a worker thread per server), in order."""
        return list(self._pool.map(lambda args: function(*args), jobs))

    def wait_until_healthy(self, timeout: float) -> None:
        """Poll every server's /health until all answer 200, for at most `timeout` seconds."""
        deadline = time.monotonic() + timeout
        pending = list(self.urls)
        while pending:
            for url in list(pending):
                try:
                    if self._client.get(url + "/health", timeout=5.0).status_code == 200:
                        pending.remove(url)
                except Exception:  # not up yet: connection refused, reset, ...
                    pass
            if pending and time.monotonic() > deadline:
                raise ServerError(
                    f"vLLM server(s) {', '.join(pending)} not healthy after {timeout:.0f}s: start them "
                    f"(python -m vllm.entrypoints.openai.api_server --model ...) or raise vllm_server_timeout"
                )
            if pending:
                time.sleep(1.0)

    def close(self) -> None:
        self._client.close()
        self._pool.shutdown(wait=False)
