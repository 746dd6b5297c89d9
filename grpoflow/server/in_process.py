"""httpx transports that hand requests to a hosted server's app in its own event loop, without a
socket: what a training run's agent programs send to the policy it hosts (`hosted.py`).

A request goes to the app as an ASGI call scheduled on the server's loop (authentication, episode
recording and every check as over HTTP), and its answer comes back whole; no connection is opened,
no HTTP is written or parsed, and no connection pool is searched. Cancelling the caller (an
episode past its timeout) cancels the call in the server's loop, as a client that hangs up does.
"""

from __future__ import annotations

import asyncio

import httpx


class InProcessTransport(httpx.AsyncBaseTransport):
    """Sends requests to `app` running in `loop` (another thread's), awaited from the caller's."""

    def __init__(self, app, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._asgi = httpx.ASGITransport(app=app, raise_app_exceptions=False)

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        await request.aread()
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(self.respond(request), self.loop))

    async def respond(self, request: httpx.Request) -> httpx.Response:
        """The app's answer to `request`, read whole (run in the server's loop)."""
        response = await self._asgi.handle_async_request(request)
        content = await response.aread()
        return httpx.Response(response.status_code, headers=response.headers.raw, content=content)


class SyncInProcessTransport(httpx.BaseTransport):
    """InProcessTransport for programs that run in threads: the caller's thread waits."""

    def __init__(self, app, loop: asyncio.AbstractEventLoop) -> None:
        self._inner = InProcessTransport(app, loop)

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        request.read()
        return asyncio.run_coroutine_threadsafe(self._inner.respond(request), self._inner.loop).result()


class InProcessConnections:
    """What every episode's client sends through when the policy is hosted in the run's own process
    (the in-process twin of `grpoflow.agents.program_client.SharedConnections`)."""

    def __init__(self, app, loop: asyncio.AbstractEventLoop) -> None:
        self._async = InProcessTransport(app, loop)
        self._sync = SyncInProcessTransport(app, loop)

    def asynchronous(self) -> InProcessTransport:
        return self._async

    def synchronous(self) -> SyncInProcessTransport:
        return self._sync

    async def aclose(self) -> None:
        """Nothing to close: no connection was opened."""
