"""DeepSeek's tool calls, V3's form and V3.1's (also DeepSeek-R1-0528's chat template):

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME
    ```json
    {...}
    ```<｜tool▁call▁end｜><｜tool▁calls▁end｜>

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜><｜tool▁calls▁end｜>

Calls follow one another inside the `<｜tool▁calls▁begin｜>` block; the content is the text before
the block and after its end. A call without `<｜tool▁sep｜>` or `<｜tool▁call▁end｜>`, or whose
arguments are not a JSON object, is a MalformedToolCall; a missing `<｜tool▁calls▁end｜>` is not
(a turn may stop right after its last call).
"""

from __future__ import annotations

import re

from grpoflow.chat.tool_formats.base import (
    MalformedToolCall,
    ParsedResponse,
    ToolCall,
    ToolSchemas,
    json_arguments_call,
)

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEPARATOR = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
EXPECTED = f"write {CALLS_BEGIN}{CALL_BEGIN}NAME{SEPARATOR}{{...}}{CALL_END}{CALLS_END}"
_FENCED = re.compile(r"(?P<name>[^\n]*)\n```(?:json)?\n(?P<arguments>.*)\n```\s*", re.DOTALL)


def parse_deepseek(text: str, schemas: ToolSchemas) -> ParsedResponse | None:
    start = text.find(CALLS_BEGIN)
    if start == -1:
        return None
    block_start = start + len(CALLS_BEGIN)
    end = text.find(CALLS_END, block_start)
    block = text[block_start:] if end == -1 else text[block_start:end]
    after = "" if end == -1 else text[end + len(CALLS_END) :]
    calls: list[ToolCall | MalformedToolCall] = []
    position = 0
    while (begin := block.find(CALL_BEGIN, position)) != -1:
        close = block.find(CALL_END, begin)
        if close == -1:
            raw = block[begin:]
            calls.append(MalformedToolCall(raw, f"the tool call is not closed with {CALL_END}; {EXPECTED}"))
            break
        raw = block[begin : close + len(CALL_END)]
        calls.append(_call(block[begin + len(CALL_BEGIN) : close], raw))
        position = close + len(CALL_END)
    if not calls:
        calls.append(MalformedToolCall(block, f"the tool calls hold no {CALL_BEGIN}; {EXPECTED}"))
    return ParsedResponse((text[:start] + after).strip(), calls)


def _call(body: str, raw: str) -> ToolCall | MalformedToolCall:
    """The call `TYPE<｜tool▁sep｜>NAME\\n```json ...```` (V3) or `NAME<｜tool▁sep｜>{...}` (V3.1)."""
    head, found, rest = body.partition(SEPARATOR)
    if not found:
        return MalformedToolCall(raw, f"the tool call has no {SEPARATOR}; {EXPECTED}")
    fenced = _FENCED.fullmatch(rest)
    if fenced is not None:
        return json_arguments_call(fenced["name"].strip(), fenced["arguments"].strip(), raw, EXPECTED)
    return json_arguments_call(head.strip(), rest.strip(), raw, EXPECTED)
