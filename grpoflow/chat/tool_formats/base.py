"""What every tool-call format returns: calls, calls that cannot be read, and the text around them.

A format is a function `(text, schemas) -> ParsedResponse | None`: None when the text holds no call
of that format. `schemas` maps a tool's name to the JSON schema of its parameters (empty when the
tools are not known); formats that write arguments as text (Qwen3-Coder's XML) type them by it.
"""

from __future__ import annotations

import contextlib
import json
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

ToolSchemas = Mapping[str, Mapping[str, Any]]
"""A tool's name -> the JSON schema of its parameters (`{"type": "object", "properties": ...}`)."""

DECODER = json.JSONDecoder()


def new_call_id() -> str:
    """An id in OpenAI's style for a call the model did not name: `call_` and 24 hex digits."""
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One call the model made: a tool's name and its arguments."""

    name: str
    arguments: dict[str, Any]
    id: str = field(default_factory=new_call_id)
    """The id an OpenAI-format `tool_calls` entry carries, and a `tool` message answers."""


@dataclass(frozen=True, slots=True)
class MalformedToolCall:
    """A call that cannot be read; its message is shown to the model instead of a tool's answer."""

    text: str
    """The raw text of the call."""
    message: str
    """What is wrong, phrased for the model."""


@dataclass(frozen=True, slots=True)
class ParsedResponse:
    """A turn's text read for tool calls."""

    content: str
    """The text outside the calls (for gpt-oss, the final channel's text)."""
    calls: list[ToolCall | MalformedToolCall]
    reasoning: str = ""
    """The model's reasoning, where the format sets it apart (gpt-oss's analysis channel)."""


ToolCallFormat = Callable[[str, ToolSchemas], ParsedResponse | None]


def tool_schemas(tools: Iterable[Mapping[str, Any]] | None) -> dict[str, Mapping[str, Any]]:
    """Parameter schemas by tool name, from OpenAI-style tools (`{"type": "function", "function":
    {...}}`) or bare function schemas (`{"name", "parameters"}`); entries without a name are skipped."""
    schemas: dict[str, Mapping[str, Any]] = {}
    for tool in tools or ():
        function = tool.get("function", tool) if isinstance(tool, Mapping) else None
        if isinstance(function, Mapping) and isinstance(function.get("name"), str):
            parameters = function.get("parameters")
            schemas[function["name"]] = parameters if isinstance(parameters, Mapping) else {}
    return schemas


def expected_json(arguments_key: str = "arguments") -> str:
    return f'write {{"name": "<tool>", "{arguments_key}": {{...}}}}'


def call_from_json(body: str, arguments_key: str, call_id: str | None = None) -> ToolCall | MalformedToolCall:
    """The call a JSON object `{"name", "arguments" | "parameters"}` makes; missing arguments: {}."""
    try:
        payload = json.loads(body)
    except json.JSONDecodeError as error:
        return MalformedToolCall(
            body, f"the tool call is not valid JSON ({error.msg}); {expected_json(arguments_key)}"
        )
    if not isinstance(payload, dict) or not isinstance(payload.get("name"), str) or not payload["name"]:
        return MalformedToolCall(body, f"the tool call names no tool; {expected_json(arguments_key)}")
    arguments = payload.get("arguments", payload.get("parameters", {}))
    return arguments_call(payload["name"], arguments, body, expected_json(arguments_key), call_id)


def arguments_call(
    name: str, arguments: Any, text: str, expected: str, call_id: str | None = None
) -> ToolCall | MalformedToolCall:
    """The call of `name` with `arguments` (an object, or a JSON string of one), else malformed."""
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        with contextlib.suppress(json.JSONDecodeError):
            arguments = json.loads(arguments)
    if not isinstance(arguments, dict):
        return MalformedToolCall(text, f"the arguments of {name!r} are not a JSON object; {expected}")
    return ToolCall(name, arguments) if call_id is None else ToolCall(name, arguments, call_id)


def json_arguments_call(name: str, body: str, text: str, expected: str) -> ToolCall | MalformedToolCall:
    """The call of `name` whose arguments are the JSON object `body`, else malformed."""
    if not name:
        return MalformedToolCall(text, f"the tool call names no tool; {expected}")
    try:
        arguments = json.loads(body)
    except json.JSONDecodeError as error:
        return MalformedToolCall(
            text, f"the arguments of {name!r} are not valid JSON ({error.msg}); {expected}"
        )
    return arguments_call(name, arguments, text, expected)


def skip_space(text: str, position: int) -> int:
    """The first position at or after `position` that is not whitespace."""
    while position < len(text) and text[position].isspace():
        position += 1
    return position
