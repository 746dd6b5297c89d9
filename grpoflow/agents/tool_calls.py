"""Tool calls read from a policy turn's text, in the formats of the common chat templates.

* `hermes` (Qwen2.5, Qwen3): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks;
* `llama3_json` (Llama 3.1/3.2): the turn is `{"name": ..., "parameters": {...}}`, optionally
  after `<|python_tag|>`, several separated by `;`;
* `auto`: hermes when the text has a `<tool_call>` tag, else llama3_json.

A call that cannot be read is a `MalformedToolCall` whose message is shown to the model, never an
exception.
"""

from __future__ import annotations

import contextlib
import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:12]}")


@dataclass(frozen=True, slots=True)
class MalformedToolCall:
    text: str
    """The raw text of the call."""
    message: str
    """What is wrong, phrased for the model."""


@dataclass(frozen=True, slots=True)
class ParsedResponse:
    content: str
    """The text outside the calls."""
    calls: list[ToolCall | MalformedToolCall]


_HERMES = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)
_EXPECTED = 'write {"name": "<tool>", "arguments": {...}}'


def parse_tool_calls(text: str, format: str = "auto") -> ParsedResponse:
    """The calls in `text` under `format` (a key of TOOL_CALL_FORMATS)."""
    if format not in TOOL_CALL_FORMATS:
        raise ValueError(f"tool_call_parser must be one of {', '.join(TOOL_CALL_FORMATS)}, got {format!r}")
    return TOOL_CALL_FORMATS[format](text)


def parse_hermes(text: str) -> ParsedResponse:
    calls: list[ToolCall | MalformedToolCall] = []
    for match in _HERMES.finditer(text):
        body = match.group(1).strip()
        if not match.group(0).endswith("</tool_call>"):
            calls.append(MalformedToolCall(match.group(0), "the tool call is not closed with </tool_call>"))
            continue
        calls.append(_call_from_json(body, "arguments"))
    return ParsedResponse(_HERMES.sub("", text).strip(), calls)


def parse_llama3_json(text: str) -> ParsedResponse:
    body = text.strip().removeprefix("<|python_tag|>").strip()
    if not body.startswith("{"):
        return ParsedResponse(text, [])
    parts = _split_top_level(body)
    return ParsedResponse("", [_call_from_json(part, "parameters") for part in parts])


def parse_auto(text: str) -> ParsedResponse:
    return parse_hermes(text) if "<tool_call>" in text else parse_llama3_json(text)


TOOL_CALL_FORMATS: dict[str, Callable[[str], ParsedResponse]] = {
    "hermes": parse_hermes,
    "llama3_json": parse_llama3_json,
    "auto": parse_auto,
}
"""Parsers by the name `tool_call_parser` takes."""


def _call_from_json(body: str, arguments_key: str) -> ToolCall | MalformedToolCall:
    try:
        payload = json.loads(body)
    except json.JSONDecodeError as error:
        return MalformedToolCall(body, f"the tool call is not valid JSON ({error.msg}); {_EXPECTED}")
    if not isinstance(payload, dict) or not isinstance(payload.get("name"), str) or not payload["name"]:
        return MalformedToolCall(body, f"the tool call names no tool; {_EXPECTED}")
    arguments = payload.get("arguments", payload.get(arguments_key, payload.get("parameters", {})))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        with contextlib.suppress(json.JSONDecodeError):
            arguments = json.loads(arguments)
    if not isinstance(arguments, dict):
        return MalformedToolCall(
            body, f"the arguments of {payload['name']!r} are not a JSON object; {_EXPECTED}"
        )
    return ToolCall(payload["name"], arguments)


def _split_top_level(body: str) -> list[str]:
    """`{...}; {...}` split at the semicolons outside JSON strings and braces."""
    parts, depth, start, in_string, escaped = [], 0, 0, False, False
    for index, char in enumerate(body):
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
            continue
        if char == '"':
            in_string = True
        elif char in "{[":
            depth += 1
        elif char in "}]":
            depth -= 1
        elif char == ";" and depth == 0:
            parts.append(body[start:index].strip())
            start = index + 1
    parts.append(body[start:].strip())
    return [part for part in parts if part]
