"""JSON tool calls: hermes (Qwen2.5, Qwen3) and llama3_json (Llama 3.1/3.2).

* hermes: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks anywhere in the text;
  the content is the text outside them (a Qwen3 `<think>` block stays in it). Unlike vLLM's
  parser, a block is closed by the first `</tool_call>` after its JSON value, so a `</tool_call>`
  inside a JSON string does not cut the call short.
* llama3_json: the whole turn is `{"name": ..., "parameters": {...}}` (or `"arguments"`),
  optionally after `<|python_tag|>`, several separated by `;`. Text that does not start with `{`
  (after the tag) holds no call: Llama's built-in tools (`brave_search.call(...)`) are not read.
"""

from __future__ import annotations

import contextlib
import json

from grpoflow.chat.tool_formats.base import (
    DECODER,
    MalformedToolCall,
    ParsedResponse,
    ToolCall,
    ToolSchemas,
    call_from_json,
    expected_json,
    skip_space,
)

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"


def parse_hermes(text: str, schemas: ToolSchemas) -> ParsedResponse | None:
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
            message = f"the tool call is not closed with {HERMES_CLOSE}; {expected_json('arguments')}"
            calls.append(MalformedToolCall(text[start:], message))
            position = len(text)
            break
        calls.append(call_from_json(text[body_start:body_end].strip(), "arguments"))
        position = body_end + len(HERMES_CLOSE)
    outside.append(text[position:])
    return ParsedResponse("".join(outside).strip(), calls)


def parse_llama3_json(text: str, schemas: ToolSchemas) -> ParsedResponse | None:
    body = text.strip().removeprefix(PYTHON_TAG).strip()
    if not body.startswith("{"):
        return None
    return ParsedResponse("", [call_from_json(part, "parameters") for part in _split_top_level(body)])


def _hermes_body_end(text: str, body_start: int) -> int | None:
    """Where the `</tool_call>` closing the block opened before `body_start` begins: the first one
    after a JSON value that starts the block, else the first one at all; None when unclosed."""
    with contextlib.suppress(json.JSONDecodeError):
        _, value_end = DECODER.raw_decode(text, skip_space(text, body_start))
        after = skip_space(text, value_end)
        if text.startswith(HERMES_CLOSE, after):
            return after
    end = text.find(HERMES_CLOSE, body_start)
    return None if end == -1 else end


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
