"""Text of prompts and completions, whether plain strings or conversations."""

from __future__ import annotations

from typing import Any


def content_text(item: Any) -> str:
    """The text of a completion or prompt.

    A string is returned as is; a conversation (list of message dicts, TRL's format) gives the
    content of its last message; multimodal content (a list of parts) gives its text parts joined.
    """
    if isinstance(item, str):
        return item
    if isinstance(item, dict):
        return _message_content(item)
    if isinstance(item, (list, tuple)):
        return _message_content(item[-1]) if item else ""
    raise TypeError(f"Expected a string or a list of message dicts, got {type(item).__name__}: {item!r:.100}")


def _message_content(message: Any) -> str:
    if not isinstance(message, dict):
        raise TypeError(f"Expected a message dict with a 'content' key, got {type(message).__name__}")
    content = message.get("content", "")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = [
        part.get("text", "") for part in content if isinstance(part, dict) and part.get("type") == "text"
    ]
    return "".join(parts)


def preview(item: Any, limit: int = 200) -> str:
    """At most `limit` characters of an item's text, for error messages."""
    try:
        text = content_text(item)
    except TypeError:
        text = repr(item)
    return text if len(text) <= limit else text[:limit] + "..."
