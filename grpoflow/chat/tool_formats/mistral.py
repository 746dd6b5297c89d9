"""Mistral's tool calls, as the text of a turn decoded with its control tokens kept:

    [TOOL_CALLS] [{"name": "NAME", "arguments": {...}}, ...]       (Mistral 7B v0.3, Nemo, Small 3.1)
    [TOOL_CALLS]NAME[ARGS]{...}[TOOL_CALLS]NAME[ARGS]{...}          (Small 3.2, Magistral, Devstral)

with an optional `[CALL_ID]ID` before `[ARGS]` (tokenizer v11). The content is the text before the
first `[TOOL_CALLS]` (and any text after a call's JSON). Each call gets a new id of 9 letters and
digits, the only ids Mistral's chat templates accept in the `tool` message answering it. A call
whose JSON cannot be read, without a name, or without `[ARGS]` is a MalformedToolCall.
"""

from __future__ import annotations

import json
import uuid

from grpoflow.chat.tool_formats.base import (
    DECODER,
    MalformedToolCall,
    ParsedResponse,
    ToolCall,
    ToolSchemas,
    arguments_call,
    skip_space,
)

TOOL_CALLS, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
EXPECTED = f"write {TOOL_CALLS}NAME{ARGS}{{...}}"


def new_mistral_call_id() -> str:
    """A call id as Mistral's templates require it: 9 letters and digits."""
    return uuid.uuid4().hex[:9]


def parse_mistral(text: str, schemas: ToolSchemas) -> ParsedResponse | None:
    if TOOL_CALLS not in text:
        return None
    content, *segments = text.split(TOOL_CALLS)
    outside = [content]
    calls: list[ToolCall | MalformedToolCall] = []
    for segment in segments:
        start = skip_space(segment, 0)
        if segment.startswith(("[", "{"), start):
            found, rest = _json_calls(segment, start)
        else:
            found, rest = _named_call(segment)
        calls += found
        outside.append(rest)
    return ParsedResponse("".join(outside).strip(), calls)


def _json_calls(segment: str, start: int) -> tuple[list[ToolCall | MalformedToolCall], str]:
    """The calls of `[{"name", "arguments"}, ...]` (or one object), and the text after it."""
    try:
        payload, end = DECODER.raw_decode(segment, start)
    except json.JSONDecodeError as error:
        return [
            MalformedToolCall(segment, f"the tool calls are not valid JSON ({error.msg}); {EXPECTED}")
        ], ""
    raw = segment[start:end]
    calls = []
    for item in payload if isinstance(payload, list) else [payload]:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str) or not item["name"]:
            calls.append(MalformedToolCall(raw, f"a tool call names no tool; {EXPECTED}"))
            continue
        arguments = item.get("arguments", {})
        calls.append(arguments_call(item["name"], arguments, raw, EXPECTED, new_mistral_call_id()))
    return calls, segment[end:]


def _named_call(segment: str) -> tuple[list[ToolCall | MalformedToolCall], str]:
    """The call `NAME[CALL_ID]ID[ARGS]{...}`, and the text after its JSON."""
    head, found, rest = segment.partition(ARGS)
    name = head.partition(CALL_ID)[0].strip()
    if not found or not name:
        return [MalformedToolCall(segment, f"the tool call has no name or no {ARGS}; {EXPECTED}")], ""
    start = skip_space(rest, 0)
    try:
        arguments, end = DECODER.raw_decode(rest, start)
    except json.JSONDecodeError as error:
        message = f"the arguments of {name!r} are not valid JSON ({error.msg}); {EXPECTED}"
        return [MalformedToolCall(segment, message)], ""
    call = arguments_call(
        name, arguments, segment[: len(head) + len(ARGS) + end], EXPECTED, new_mistral_call_id()
    )
    return [call], rest[end:]
