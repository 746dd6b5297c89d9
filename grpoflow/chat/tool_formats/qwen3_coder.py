"""Qwen3-Coder's XML tool calls (also Qwen3.5's and Nemotron 3's chat templates):

    <tool_call>
    <function=NAME>
    <parameter=ARG>
    VALUE
    </parameter>
    </function>
    </tool_call>

A value is text, one newline around it trimmed, typed by the tool's parameter schema when it is
known: integers, numbers and booleans (`true`, or Python's `True` the template writes) as such,
objects and arrays as JSON, `null` (or `None`) where the schema allows it, strings otherwise (and
for every parameter of an unknown tool). A value that does not fit its type, an unclosed tag or a
block that is not this shape is a MalformedToolCall. A value ends at the first `</parameter>`
followed by the next `<parameter=` or `</function>`, so a value may hold `</parameter>` itself.
The content is the text outside the blocks.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from grpoflow.chat.tool_formats.base import (
    MalformedToolCall,
    ParsedResponse,
    ToolCall,
    ToolSchemas,
    skip_space,
)

OPEN, CLOSE = "<tool_call>", "</tool_call>"
FUNCTION, FUNCTION_CLOSE = "<function=", "</function>"
PARAMETER, PARAMETER_CLOSE = "<parameter=", "</parameter>"
EXPECTED = f"write {OPEN}\\n{FUNCTION}NAME>\\n{PARAMETER}ARG>\\nvalue\\n{PARAMETER_CLOSE}\\n{FUNCTION_CLOSE}\\n{CLOSE}"


class _Malformed(ValueError):
    """A block that cannot be read, with the message for the model."""


def holds_xml_call(text: str) -> bool:
    """Whether the first `<tool_call>` in `text` opens a `<function=` block."""
    start = text.find(OPEN)
    return start != -1 and text.startswith(FUNCTION, skip_space(text, start + len(OPEN)))


def parse_qwen3_coder(text: str, schemas: ToolSchemas) -> ParsedResponse | None:
    if OPEN not in text:
        return None
    outside: list[str] = []
    calls: list[ToolCall | MalformedToolCall] = []
    position = 0
    while (start := text.find(OPEN, position)) != -1:
        outside.append(text[position:start])
        try:
            call, position = _read_block(text, start, schemas)
        except _Malformed as error:
            close = text.find(CLOSE, start)
            position = len(text) if close == -1 else close + len(CLOSE)
            call = MalformedToolCall(text[start:position], f"{error}; {EXPECTED}")
        calls.append(call)
    outside.append(text[position:])
    return ParsedResponse("".join(outside).strip(), calls)


def _read_block(text: str, start: int, schemas: ToolSchemas) -> tuple[ToolCall, int]:
    """The call of the block opened at `start`, and the position after its `</tool_call>`."""
    position = skip_space(text, start + len(OPEN))
    if not text.startswith(FUNCTION, position):
        raise _Malformed(f"the tool call does not start with {FUNCTION}NAME>")
    name, position = _tag_value(text, position + len(FUNCTION), "function")
    schema = schemas.get(name, {})
    arguments: dict[str, Any] = {}
    while True:
        position = skip_space(text, position)
        if text.startswith(PARAMETER, position):
            parameter, value_start = _tag_value(text, position + len(PARAMETER), "parameter")
            value_end = _value_end(text, value_start, parameter)
            raw = _trim_newlines(text[value_start:value_end])
            arguments[parameter] = typed_value(raw, _property(schema, parameter), parameter, name)
            position = value_end + len(PARAMETER_CLOSE)
        elif text.startswith(FUNCTION_CLOSE, position):
            position = skip_space(text, position + len(FUNCTION_CLOSE))
            if not text.startswith(CLOSE, position):
                raise _Malformed(f"the tool call of {name!r} is not closed with {CLOSE}")
            return ToolCall(name, arguments), position + len(CLOSE)
        else:
            raise _Malformed(
                f"the tool call of {name!r} has text where {PARAMETER} or {FUNCTION_CLOSE} belongs"
            )


def _tag_value(text: str, position: int, tag: str) -> tuple[str, int]:
    """The name in `<tag=NAME>` read from `position` (after `=`), and the position after `>`."""
    end = text.find(">", position)
    name = "" if end == -1 else text[position:end].strip()
    if not name or "\n" in name or "<" in name:
        raise _Malformed(f"a <{tag}=...> tag names nothing or is not closed with >")
    return name, end + 1


def _value_end(text: str, value_start: int, parameter: str) -> int:
    """Where the value from `value_start` ends: the first `</parameter>` that the next tag follows,
    else the first one at all."""
    first = end = text.find(PARAMETER_CLOSE, value_start)
    if first == -1:
        raise _Malformed(f"the parameter {parameter!r} is not closed with {PARAMETER_CLOSE}")
    while end != -1:
        after = skip_space(text, end + len(PARAMETER_CLOSE))
        if text.startswith((PARAMETER, FUNCTION_CLOSE), after):
            return end
        end = text.find(PARAMETER_CLOSE, end + 1)
    return first


def _trim_newlines(value: str) -> str:
    value = value[1:] if value.startswith("\n") else value
    return value[:-1] if value.endswith("\n") else value


def _property(schema: Mapping[str, Any], parameter: str) -> Mapping[str, Any]:
    properties = schema.get("properties")
    found = properties.get(parameter) if isinstance(properties, Mapping) else None
    return found if isinstance(found, Mapping) else {}


def _types(schema: Mapping[str, Any]) -> list[str]:
    kind = schema.get("type")
    if isinstance(kind, str):
        return [kind]
    if isinstance(kind, list):
        return [k for k in kind if isinstance(k, str)]
    options = schema.get("anyOf") or schema.get("oneOf") or []
    return [t for option in options if isinstance(option, Mapping) for t in _types(option)]


def typed_value(raw: str, schema: Mapping[str, Any], parameter: str, tool: str) -> Any:
    """`raw` as the type `schema` gives (see the module docstring); a string when it gives none."""
    types = _types(schema)
    if "null" in types and raw.strip() in ("null", "None"):
        return None
    if not types or "string" in types:
        return raw
    for kind in types:
        value = _converted(raw.strip(), kind)
        if value is not _MISSING:
            return value
    raise _Malformed(
        f"the parameter {parameter!r} of {tool!r} must be {' or '.join(types)}, got {raw[:100]!r}"
    )


_MISSING = object()


def _converted(raw: str, kind: str) -> Any:
    """`raw` as a JSON schema `kind`, or _MISSING when it is not one."""
    if kind == "boolean":
        return {"true": True, "false": False}.get(raw.lower(), _MISSING)
    if kind in ("integer", "number"):
        try:
            return int(raw)
        except ValueError:
            pass
        if kind == "number":
            try:
                return float(raw)
            except ValueError:
                return _MISSING
        return _MISSING
    if kind in ("object", "array"):
        try:
            value = json.loads(raw)
        except json.JSONDecodeError:
            return _MISSING
        return value if isinstance(value, dict if kind == "object" else list) else _MISSING
    return _MISSING
