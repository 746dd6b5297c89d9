"""Tool calls read from a policy turn's text, in the formats of the common chat templates.

Formats, by the name `tool_call_parser` takes (vLLM's names); grpoflow.chat.tool_formats has one
module per family, each describing its format:

* `hermes` (Qwen2.5, Qwen3): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`.
* `qwen3_coder` (Qwen3-Coder, Qwen3.5, Nemotron 3): `<tool_call><function=NAME><parameter=ARG>...`,
  values typed by the tool's parameter schema.
* `llama3_json` (Llama 3.1/3.2): the whole turn is `{"name": ..., "parameters": {...}}`.
* `deepseek_v3` (DeepSeek V3, R1, V3.1; also `deepseek_v31`):
  `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>...<｜tool▁call▁end｜><｜tool▁calls▁end｜>`.
* `mistral`: `[TOOL_CALLS]` and a JSON list of calls, or `[TOOL_CALLS]NAME[ARGS]{...}`.
* `openai` (gpt-oss's harmony): `<|channel|>commentary to=functions.NAME ...<|message|>{...}<|call|>`;
  the final channel is the content, the analysis channel the reasoning.
* `auto`: resolved once per run or server from the tokenizer's chat template (`resolve_tool_call_format`);
  where the template shows no format, each turn's text picks it by its markers.

A call that cannot be read is a `MalformedToolCall` whose message is shown to the model, never an
exception.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from grpoflow.chat.tool_formats.base import (
    MalformedToolCall,
    ParsedResponse,
    ToolCall,
    ToolCallFormat,
    ToolSchemas,
    new_call_id,
    tool_schemas,
)
from grpoflow.chat.tool_formats.deepseek import CALLS_BEGIN, parse_deepseek
from grpoflow.chat.tool_formats.harmony import CHANNEL, parse_harmony
from grpoflow.chat.tool_formats.json_calls import HERMES_OPEN, PYTHON_TAG, parse_hermes, parse_llama3_json
from grpoflow.chat.tool_formats.mistral import TOOL_CALLS, parse_mistral
from grpoflow.chat.tool_formats.qwen3_coder import FUNCTION, holds_xml_call, parse_qwen3_coder

__all__ = [
    "TOOL_CALL_FORMATS",
    "MalformedToolCall",
    "ParsedResponse",
    "ToolCall",
    "ToolCallFormat",
    "check_tool_call_format",
    "format_of_template",
    "new_call_id",
    "parse_tool_calls",
    "register_tool_call_format",
    "resolve_tool_call_format",
]

logger = logging.getLogger("grpoflow.chat")

TOOL_CALL_FORMATS: dict[str, ToolCallFormat] = {}
"""Parsers by the name `tool_call_parser` takes: `(text, schemas) -> ParsedResponse | None`, None
for text without their calls (grpoflow.chat.tool_formats.base)."""


def register_tool_call_format(name: str) -> Callable[[ToolCallFormat], ToolCallFormat]:
    """Register a parser under `name` (a decorator), so `parse_tool_calls(text, name)` uses it."""

    def register(parser: ToolCallFormat) -> ToolCallFormat:
        TOOL_CALL_FORMATS[name] = parser
        return parser

    return register


def parse_tool_calls(
    text: str, format: str = "auto", tools: Iterable[Mapping[str, Any]] | None = None
) -> ParsedResponse:
    """The calls in `text` under `format` (a key of TOOL_CALL_FORMATS); none: the text as content.
    `tools` (OpenAI-style tool schemas) types the arguments of formats that write them as text."""
    check_tool_call_format(format)
    parsed = TOOL_CALL_FORMATS[format](text, tool_schemas(tools))
    return parsed if parsed is not None else ParsedResponse(text, [])


def check_tool_call_format(format: str) -> None:
    """Raise ValueError naming the known formats when `format` is none of them."""
    if format not in TOOL_CALL_FORMATS:
        raise ValueError(f"tool_call_parser must be one of {', '.join(TOOL_CALL_FORMATS)}, got {format!r}")


def parse_auto(text: str, schemas: ToolSchemas) -> ParsedResponse | None:
    """The format whose markers the text holds: harmony, DeepSeek, Mistral, Qwen3-Coder's XML,
    hermes, else llama3_json."""
    if CHANNEL in text:
        return parse_harmony(text, schemas)
    if CALLS_BEGIN in text:
        return parse_deepseek(text, schemas)
    if TOOL_CALLS in text:
        return parse_mistral(text, schemas)
    if holds_xml_call(text):
        return parse_qwen3_coder(text, schemas)
    return parse_hermes(text, schemas) or parse_llama3_json(text, schemas)


for _name, _parser in {
    "hermes": parse_hermes,
    "qwen3_coder": parse_qwen3_coder,
    "llama3_json": parse_llama3_json,
    "deepseek_v3": parse_deepseek,
    "deepseek_v31": parse_deepseek,
    "mistral": parse_mistral,
    "openai": parse_harmony,
    "auto": parse_auto,
}.items():
    register_tool_call_format(_name)(_parser)

TEMPLATE_MARKERS: tuple[tuple[str, str], ...] = (
    (CHANNEL, "openai"),
    (CALLS_BEGIN, "deepseek_v3"),
    (TOOL_CALLS, "mistral"),
    (FUNCTION, "qwen3_coder"),
    ("<arg_key>", "auto"),
    (HERMES_OPEN, "hermes"),
    (PYTHON_TAG, "llama3_json"),
    ('"parameters": dictionary', "llama3_json"),
)
"""What in a chat template shows its tool-call format, first match wins: Qwen3-Coder's templates
also hold `<tool_call>`, and so do GLM-4.5's (`<tool_call>NAME<arg_key>...`), a format none here
reads."""


def format_of_template(template: str | Mapping[str, str] | None) -> str:
    """The tool-call format a chat template renders (a name of TOOL_CALL_FORMATS); `auto` when it
    shows none of TEMPLATE_MARKERS. A mapping of named templates is read whole."""
    if isinstance(template, Mapping):
        template = "\n".join(str(value) for value in template.values())
    for marker, format in TEMPLATE_MARKERS:
        if template and marker in template:
            return format
    return "auto"


def resolve_tool_call_format(format: str, tokenizer: Any) -> str:
    """The format to read a run's (or a server's) turns with: `format` itself unless it is `auto`,
    else the one the tokenizer's chat template renders; the choice is logged."""
    check_tool_call_format(format)
    if format != "auto":
        return format
    chosen = format_of_template(getattr(tokenizer, "chat_template", None))
    if chosen == "auto":
        logger.info(
            "tool_call_parser auto: the chat template shows no known tool-call format; each turn's "
            "text picks it by its markers (set tool_call_parser to one of %s to fix it)",
            ", ".join(name for name in TOOL_CALL_FORMATS if name != "auto"),
        )
    else:
        logger.info("tool_call_parser auto: %s, from the chat template", chosen)
    return chosen
