"""HTTP to the rollout servers: requests whose errors name the server, a wait for /health, and one
worker thread per server to call them all at once."""

from __future__ import annotations

import concurrent.futures
import json
import os
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from grpoflow.threads import in_daemon_thread
from grpoflow.transport import ServerError


def server_urls(base_url: str | None, host: str | None, port: int) -> list[str]:
    """The servers' base URLs: `base_url` split on commas, else http://host:port."""
    if base_url:
        urls = [url.strip().rstrip("/") for url in base_url.split(",") if url.strip()]
        if not urls:
            raise ValueError(f"vllm_server_base_url={base_url!r} names no server")
        return [url if "://" in url else f"http://{url}" for url in urls]
    return [f"http://{host or '127.0.0.1'}:{port}"]


API_KEY_ENV = "VLLM_API_KEY"
"""The environment variable a key is read from when the config names none (vLLM's)."""
RETRY_STATUSES = (502, 503, 504)
"""Answers worth another try: the server (or a proxy before it) is restarting or overloaded."""
RETRY_BACKOFF_S = 0.5


class ServerClient:
    """One HTTP client for the servers at `urls` (vLLM's OpenAI-compatible server, or grpoflow serve).

    Every call has a total deadline (`timeout`, default `request_timeout`): a server that answers
    one byte at a time is cut off there, not after a per-read timeout per byte. Idempotent calls
    (GETs, and calls made with `retries`) are retried on connection failures and 502/503/504, with
    backoff, within the same deadline. With an API key (`api_key`, else VLLM_API_KEY) every call
    sends `Authorization: Bearer KEY`."""

    def __init__(
        self, urls: Sequence[str], *, request_timeout: float = 3600.0, api_key: str | None = None
    ) -> None:
        import httpx

        if not urls:
            raise ValueError("a ServerClient needs at least one server URL")
        self.urls = list(urls)
        self.request_timeout = request_timeout
        key = api_key or os.environ.get(API_KEY_ENV)
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        self._client = httpx.Client(timeout=httpx.Timeout(request_timeout, connect=10.0), headers=headers)
        self._pool = ThreadPoolExecutor(max_workers=len(self.urls))

    def request(
        self,
        method: str,
        url: str,
        path: str,
        *,
        timeout: float | None = None,
        retries: int | None = None,
        text: bool = False,
        **kwargs: Any,
    ) -> Any:
        """`method url+path` (kwargs as httpx takes them) within `timeout` seconds in all; the
        answer's JSON (None for an empty body), or ServerError naming the server, the call and what
        went wrong. `retries`: further tries after a failure worth retrying (default 2 for GET, 0
        otherwise). `text`: the answer is plain text (vLLM's LoRA routes): return it as a str."""
        timeout = timeout or self.request_timeout
        retries = (2 if method == "GET" else 0) if retries is None else retries
        deadline = time.monotonic() + timeout
        call = f"vLLM server {url}: {method} {path}"
        for attempt in range(retries + 1):
            try:
                status, content = self._within(deadline, self._once, method, url + path, deadline, kwargs)
            except _Retryable as failure:
                pause = RETRY_BACKOFF_S * 2**attempt
                if attempt == retries or time.monotonic() + pause >= deadline:
                    raise ServerError(f"{call} failed ({failure}); is the server running there?") from None
                time.sleep(pause)
                continue
            except _DeadlinePassed:
                raise ServerError(f"{call} did not complete within {timeout:g}s") from None
            if status in RETRY_STATUSES and attempt < retries:
                time.sleep(min(RETRY_BACKOFF_S * 2**attempt, max(0.0, deadline - time.monotonic())))
                continue
            if status != 200:
                detail = content[:1000].decode("utf-8", "replace")
                raise ServerError(
                    f"vLLM server {url} answered {method} {path} with HTTP {status}: {detail}", status
                )
            if text:
                return content.decode("utf-8", "replace")
            if not content:
                return None
            try:
                return json.loads(content)
            except ValueError:
                preview = content[:200].decode("utf-8", "replace")
                raise ServerError(f"{call} answered with a body that is not JSON: {preview!r}") from None
        raise AssertionError("unreachable")

    @staticmethod
    def _within(deadline: float, function: Callable[..., Any], *args: Any) -> Any:
        """`function(*args)` in a daemon thread, given up at `deadline` even if it is stuck in a
        read (it then stops by itself at its next chunk or its own read timeout)."""
        future = in_daemon_thread(function, *args)
        try:
            return future.result(timeout=max(0.0, deadline - time.monotonic()))
        except concurrent.futures.TimeoutError:
            raise _DeadlinePassed from None

    def _once(self, method: str, url: str, deadline: float, kwargs: dict) -> tuple[int, bytes]:
        """One try: the status and the whole body, read as it arrives and abandoned at `deadline`."""
        import httpx

        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise _DeadlinePassed
        limit = httpx.Timeout(remaining, connect=min(10.0, remaining))
        try:
            with self._client.stream(method, url, timeout=limit, **kwargs) as response:
                chunks = []
                for chunk in response.iter_bytes():
                    chunks.append(chunk)
                    if time.monotonic() > deadline:
                        raise _DeadlinePassed
                return response.status_code, b"".join(chunks)
        except httpx.TimeoutException:
            raise _DeadlinePassed from None
        except httpx.HTTPError as error:
            raise _Retryable(str(error) or type(error).__name__) from None

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


class _Retryable(Exception):
    """A try that failed before an answer came (connection refused, reset, protocol error)."""


class _DeadlinePassed(Exception):
    """The call's total time ran out."""
