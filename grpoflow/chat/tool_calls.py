"""Tool calls read from a policy turn's text, in the formats of the common chat templates.

* `hermes` (Qwen2.5, Qwen3): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks
  anywhere in the text; the content is the text outside them (a Qwen3 `<think>` block stays in it).
* `llama3_json` (Llama 3.1/3.2): the whole turn is `{"name": ..., "parameters": {...}}` (or
  `"arguments"`), optionally after `<|python_tag|>`, several separated by `;`. Text that does not
  start with `{` (after the tag) holds no call: Llama's built-in tools (`brave_search.call(...)`)
  are not read.
* `auto`: the first of hermes, llama3_json that finds calls in the text.

Each format is a function `text -> ParsedResponse | None`, None when the text holds no call of that
format. A call that cannot be read (bad JSON, no name, arguments that are not an object, an
unclosed `<tool_call>`) is a `MalformedToolCall` whose message is shown to the model, never an
exception. Unlike vLLM's parsers, a hermes block is closed by the first `</tool_call>` after its
JSON value, so a `</tool_call>` inside a JSON string does not cut the call short.
"""

from __future__ import annotations

import contextlib
import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
_DECODER = json.JSONDecoder()


def new_call_id() -> str:
    """An id in OpenAI's style for a call the model did not name: `call_` and 24 hex digits."""
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True, slots=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]
    id: str = field(default_factory=new_call_id)
    """The id an OpenAI-format `tool_calls` entry carries, and a `tool` message answers."""


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


ToolCallFormat = Callable[[str], ParsedResponse | None]
TOOL_CALL_FORMATS: dict[str, ToolCallFormat] = {}
"""Parsers by the name `tool_call_parser` takes; each returns None for text without its calls."""


def register_tool_call_format(name: str) -> Callable[[ToolCallFormat], ToolCallFormat]:
    """Register a parser under `name` (a decorator), so `parse_tool_calls(text, name)` uses it."""

    def register(parser: ToolCallFormat) -> ToolCallFormat:
        TOOL_CALL_FORMATS[name] = parser
        return parser

    return register


def parse_tool_calls(text: str, format: str = "auto") -> ParsedResponse:
    """The calls in `text` under `format` (a key of TOOL_CALL_FORMATS); none: the text as content."""
    check_tool_call_format(format)
    parsed = TOOL_CALL_FORMATS[format](text)
    return parsed if parsed is not None else ParsedResponse(text, [])


def check_tool_call_format(format: str) -> None:
    """Raise ValueError naming the known formats when `format` is none of them."""
    if format not in TOOL_CALL_FORMATS:
        raise ValueError(f"tool_call_parser must be one of {', '.join(TOOL_CALL_FORMATS)}, got {format!r}")


@register_tool_call_format("hermes")
def parse_hermes(text: str) -> ParsedResponse | None:
    if HERMES_OPEN not in text:
        return None
    outside: list[str] = []
    calls: list[ToolCall | MalformedToolCall] = []
    position = 0
    while (start := text.find(HERMES_OPEN, position)) != -1:
        outside.append(text[position:start])
        body_start = start + len(HERMES_OPEN)
        body_end = _hermes_body_end(text, body_start)
        if body_end is None:
            message = f"the tool call is not closed with {HERMES_CLOSE}; {_expected('arguments')}"
            calls.append(MalformedToolCall(text[start:], message))
            position = len(text)
            break
        calls.append(_call_from_json(text[body_start:body_end].strip(), "arguments"))
        position = body_end + len(HERMES_CLOSE)
    outside.append(text[position:])
    return ParsedResponse("".join(outside).strip(), calls)


@register_tool_call_format("llama3_json")
def parse_llama3_json(text: str) -> ParsedResponse | None:
    body = text.strip().removeprefix(PYTHON_TAG).strip()
    if not body.startswith("{"):
        return None
    return ParsedResponse("", [_call_from_json(part, "parameters") for part in _split_top_level(body)])


@register_tool_call_format("auto")
def parse_auto(text: str) -> ParsedResponse | None:
    return parse_hermes(text) or parse_llama3_json(text)


def _hermes_body_end(text: str, body_start: int) -> int | None:
    """Where the `</tool_call>` closing the block opened before `body_start` begins: the first one
    after a JSON value that starts the block, else the first one at all; None when unclosed."""
    value_start = body_start + len(text[body_start:]) - len(text[body_start:].lstrip())
    with contextlib.suppress(json.JSONDecodeError):
        _, value_end = _DECODER.raw_decode(text, value_start)
        after = value_end + len(text[value_end:]) - len(text[value_end:].lstrip())
        if text.startswith(HERMES_CLOSE, after):
            return after
    end = text.find(HERMES_CLOSE, body_start)
    return None if end == -1 else end


def _expected(arguments_key: str) -> str:
    return f'write {{"name": "<tool>", "{arguments_key}": {{...}}}}'


def _call_from_json(body: str, arguments_key: str) -> ToolCall | MalformedToolCall:
    """The call a JSON object `{"name", "arguments" | "parameters"}` makes; missing arguments: {}."""
    try:
        payload = json.loads(body)
    except json.JSONDecodeError as error:
        return MalformedToolCall(
            body, f"the tool call is not valid JSON ({error.msg}); {_expected(arguments_key)}"
        )
    if not isinstance(payload, dict) or not isinstance(payload.get("name"), str) or not payload["name"]:
        return MalformedToolCall(body, f"the tool call names no tool; {_expected(arguments_key)}")
    arguments = payload.get("arguments", payload.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        with contextlib.suppress(json.JSONDecodeError):
            arguments = json.loads(arguments)
    if not isinstance(arguments, dict):
        return MalformedToolCall(
            body, f"the arguments of {payload['name']!r} are not a JSON object; {_expected(arguments_key)}"
        )
    return ToolCall(payload["name"], arguments)


def _split_top_level(body: str) -> list[str]:
    """`{...}; {...}` split at the semicolons outside JSON strings and brackets."""
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
