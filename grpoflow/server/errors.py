"""The server's error: an HTTP status and a message that says what to change, in OpenAI's shape."""

from __future__ import annotations

from http import HTTPStatus


class RequestError(Exception):
    """A request the server cannot serve as sent (4xx) or failed to serve (5xx)."""

    def __init__(self, message: str, status: int = 400, param: str | None = None) -> None:
        super().__init__(message)
        self.message, self.status, self.param = message, status, param

    def body(self) -> dict:
        """`{"error": {"message", "type", "param", "code"}}`, as OpenAI and vLLM answer errors."""
        kind = HTTPStatus(self.status).phrase.replace(" ", "") + "Error"
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.status}}
