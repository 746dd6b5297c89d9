"""A deadline on each request's headers, which uvicorn does not set.

uvicorn closes a keep-alive connection that stays idle (`timeout_keep_alive`), but not one that
sends part of a request line or headers and then nothing: its first byte cancels the keep-alive
timer and the connection waits for the rest for ever, so a client could hold any number of them.
`header_deadline(timeout_s)` is uvicorn's HTTP protocol with one timer more: armed when the
connection opens and again when an answer has been sent, it closes the connection unless a request
whose headers have all arrived is being answered by then. The app never sees such a connection
(it is called once the headers are complete), so this has to live in the protocol, not in ASGI.
"""

from __future__ import annotations

import asyncio
import logging

from uvicorn.protocols.http.auto import AutoHTTPProtocol

logger = logging.getLogger("grpoflow.server")


def header_deadline(timeout_s: float, base: type[asyncio.Protocol] = AutoHTTPProtocol) -> type:
    """uvicorn's HTTP protocol `base` (httptools when installed, else h11) closing connections
    that have not sent a complete request's headers `timeout_s` seconds after they opened or after
    their previous answer."""

    class HeaderDeadline(base):  # type: ignore[misc, valid-type]
        _header_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:
            super().connection_made(transport)
            self._arm_header_timer()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm_header_timer()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm_header_timer()
            super().connection_lost(exc)

        def _arm_header_timer(self) -> None:
            self._disarm_header_timer()
            self._header_timer = self.loop.call_later(timeout_s, self._headers_overdue)

        def _disarm_header_timer(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _headers_overdue(self) -> None:
            self._header_timer = None
            cycle = self.cycle
            if cycle is not None and not cycle.response_complete:
                return  # a request is being answered; its answer arms the timer again
            if not self.transport.is_closing():
                logger.info("closing a connection that sent no complete request in %.0fs", timeout_s)
                self.transport.close()

    return HeaderDeadline
