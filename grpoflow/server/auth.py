"""API keys of `grpoflow serve`: `--api-key KEY` and `--api-key-file FILE` (one key per line), any
of which a request may send as `Authorization: Bearer KEY` (compared in constant time). Every
endpoint but OPEN_PATHS needs one. With several keys each request is tagged with the key it sent,
its owner: recorded episodes are visible only to their owner (episode_recorder.py)."""

from __future__ import annotations

import hmac
from pathlib import Path

from starlette.datastructures import Headers
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from grpoflow.server.errors import RequestError
from grpoflow.server.settings import ServeConfig

OPEN_PATHS = ("/health", "/ping", "/version")
"""Paths answered without an API key (load balancers and clients probe them)."""
OWNER = "grpoflow.owner"
"""The scope key naming the API key a request was sent with (absent: the one shared owner)."""


def api_keys(config: ServeConfig) -> list[str]:
    """The keys the server takes: --api-key, then --api-key-file's lines (blank ones skipped)."""
    keys = [config.api_key] if config.api_key else []
    if config.api_key_file is not None:
        try:
            text = Path(config.api_key_file).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as error:
            raise ValueError(
                f"--api-key-file {config.api_key_file!r} cannot be read ({error}): give a UTF-8 text "
                f"file with one key per line"
            ) from None
        listed = [line.strip() for line in text.splitlines() if line.strip()]
        if not listed:
            raise ValueError(f"--api-key-file {config.api_key_file!r} holds no key: write one key per line")
        keys += listed
    return list(dict.fromkeys(keys))


def owner_of(request: Request) -> str:
    """Who a request speaks for: its API key's place among several, else '' (everyone)."""
    return request.scope.get(OWNER, "")


class BearerAuth:
    """Refuses (401) requests without `Authorization: Bearer KEY` for one of `api_keys`, except on
    OPEN_PATHS; with several keys, tags each request with its key's place (OWNER)."""

    def __init__(self, app: ASGIApp, api_keys: list[str]) -> None:
        self.app, self.expected = app, [f"Bearer {key}".encode() for key in api_keys]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope.get("method") != "OPTIONS" and scope["path"] not in OPEN_PATHS:
            # Header values arrive as bytes (Starlette decodes them as latin-1): compare the raw
            # bytes with the key's UTF-8 bytes, so a non-ASCII key matches what clients send.
            given = Headers(scope=scope).get("authorization", "").encode("latin-1")
            matches = [hmac.compare_digest(given, expected) for expected in self.expected]
            if not any(matches):
                error = RequestError("missing or wrong API key: send 'Authorization: Bearer KEY'", 401)
                response = JSONResponse(error.body(), 401, headers={"WWW-Authenticate": "Bearer"})
                await response(scope, receive, send)
                return
            if len(self.expected) > 1:
                scope[OWNER] = f"key-{matches.index(True)}"
        await self.app(scope, receive, send)
