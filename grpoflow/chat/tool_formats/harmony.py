"""gpt-oss's harmony format, as the text of a turn decoded with its special tokens kept:

    <|channel|>analysis<|message|>REASONING<|end|>
    <|start|>assistant<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>
    <|start|>assistant<|channel|>final<|message|>ANSWER<|return|>

The generation prompt ends with `<|start|>assistant`, so the turn begins inside its first header. A
message whose recipient (`to=`, in its header before or after the channel) is `functions.NAME`
calls NAME with the JSON object of its body; the final channel's text is the content, the analysis
channel's is the reasoning, and commentary without a recipient (a preamble) joins the content. A
call whose body is not a JSON object, or a message with no `<|message|>`, is a MalformedToolCall.
Built-in tools (`to=browser.search`, `to=python`) are calls under their own names.
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

START, CHANNEL, MESSAGE = "<|start|>", "<|channel|>", "<|message|>"
ENDS = ("<|end|>", "<|call|>", "<|return|>")
CONSTRAIN = "<|constrain|>"
FUNCTIONS = "functions."
EXPECTED = "write <|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>"
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")
_END = re.compile("|".join(re.escape(end) for end in ENDS))


def parse_harmony(text: str, schemas: ToolSchemas) -> ParsedResponse | None:
    if CHANNEL not in text:
        return None
    content: list[str] = []
    reasoning: list[str] = []
    calls: list[ToolCall | MalformedToolCall] = []
    for raw in (part for part in text.split(START) if part.strip()):
        header, found, rest = raw.partition(MESSAGE)
        if not found:
            calls.append(MalformedToolCall(raw, f"the message has no {MESSAGE}; {EXPECTED}"))
            continue
        end = _END.search(rest)
        body = rest if end is None else rest[: end.start()]
        recipient = _RECIPIENT.search(header)
        channel = _channel(header)
        if recipient is not None:
            name = recipient.group(1).removeprefix(FUNCTIONS)
            calls.append(json_arguments_call(name, body.strip(), raw, EXPECTED))
        elif channel == "analysis":
            reasoning.append(body)
        else:
            content.append(body)
    return ParsedResponse("\n".join(content).strip(), calls, "\n".join(reasoning).strip())


def _channel(header: str) -> str:
    """The channel a header names (`analysis`, `commentary`, `final`); '' when it names none."""
    _, _, after = header.partition(CHANNEL)
    words = after.replace(CONSTRAIN, " ").split()
    return words[0] if words else ""
