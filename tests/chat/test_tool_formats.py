"""The tool-call formats of Qwen3-Coder, gpt-oss, DeepSeek V3/V3.1 and Mistral, read back from
assistant turns their own chat templates (tests/chat/templates) render."""

import json
import logging
from pathlib import Path

import pytest

from grpoflow.chat.tool_calls import (
    MalformedToolCall,
    ToolCall,
    format_of_template,
    parse_tool_calls,
    resolve_tool_call_format,
)
from grpoflow.policy.tiny import build_char_tokenizer

TEMPLATES = Path(__file__).parent / "templates"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Search the web.",
            "parameters": {
                "type": "object",
                "properties": {
                    "query": {"type": "string"},
                    "limit": {"type": "integer"},
                    "score": {"type": "number"},
                    "exact": {"type": "boolean"},
                    "filters": {"type": "object"},
                    "sites": {"type": "array", "items": {"type": "string"}},
                    "lang": {"type": ["string", "null"]},
                },
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "now",
            "description": "The time.",
            "parameters": {"type": "object", "properties": {}},
        },
    },
]
SEARCH = {
    "query": "grpo </parameter> <tool_call> ü",
    "limit": 3,
    "score": 0.5,
    "exact": True,
    "filters": {"year": [2025, 2026], "note": 'a "b"'},
    "sites": ["a.org", "b.org"],
    "lang": "en",
}
CALLS = [("search", SEARCH), ("now", {})]
USER = [{"role": "user", "content": "find grpo"}]


TURN_STARTS = {
    "qwen3_coder": "<|im_start|>assistant\n",
    "gpt_oss": "<|start|>assistant",
    "deepseek_v3": "<｜Assistant｜>",
    "deepseek_v31": "<｜Assistant｜></think>",
    "mistral_v3": "[/INST]",
    "mistral_v11": "[/INST]",
}
"""Where each template's assistant turn starts: the text a model writes comes after it."""


def rendered_turn(
    template: str, calls, content=None, end: str = "", arguments_as_json=False, ids=False
) -> str:
    """The assistant turn making `calls` as `template` renders it, from where the model starts
    writing, without the end-of-turn token a model's stop removes."""
    tokenizer = build_char_tokenizer()
    tokenizer.chat_template = (TEMPLATES / f"{template}.jinja").read_text()
    tool_calls = [
        {
            "type": "function",
            "function": {"name": name, "arguments": json.dumps(args) if arguments_as_json else args},
            **({"id": f"abc{index:06d}"} if ids else {}),
        }
        for index, (name, args) in enumerate(calls)
    ]
    messages = [*USER, {"role": "assistant", "content": content, "tool_calls": tool_calls}]
    whole = tokenizer.apply_chat_template(messages, tools=TOOLS, tokenize=False)
    marker = TURN_STARTS[template]
    start = whole.index(marker, whole.index(USER[0]["content"])) + len(marker)
    return whole[start:].rstrip().removesuffix(end).rstrip()


def named(parsed) -> list[tuple[str, dict]]:
    assert all(isinstance(call, ToolCall) for call in parsed.calls), parsed.calls
    return [(call.name, call.arguments) for call in parsed.calls]


@pytest.mark.parametrize("format", ["qwen3_coder", "auto"])
def test_qwen3_coder_round_trip_types_values_by_the_schema(format):
    text = rendered_turn("qwen3_coder", CALLS, content="Let me look.", end="<|im_end|>")
    assert "<parameter=limit>\n3\n</parameter>" in text and "<parameter=exact>\nTrue\n" in text
    parsed = parse_tool_calls(text, format, TOOLS)
    assert named(parsed) == CALLS and parsed.content == "Let me look."


def test_qwen3_coder_without_schemas_reads_strings_and_null_where_allowed():
    text = rendered_turn("qwen3_coder", [("search", {"limit": 3, "lang": None})], end="<|im_end|>")
    assert named(parse_tool_calls(text, "qwen3_coder")) == [("search", {"limit": "3", "lang": "None"})]
    assert named(parse_tool_calls(text, "qwen3_coder", TOOLS)) == [("search", {"limit": 3, "lang": None})]


@pytest.mark.parametrize("format", ["openai", "auto"])
def test_gpt_oss_round_trip_with_analysis_as_reasoning(format):
    text = rendered_turn("gpt_oss", CALLS[:1], content="I should search.")
    assert text.startswith("<|channel|>analysis<|message|>I should search.<|end|>")
    assert "<|start|>assistant to=functions.search<|channel|>commentary json<|message|>" in text
    parsed = parse_tool_calls(text, format, TOOLS)
    assert named(parsed) == CALLS[:1] and parsed.content == "" and parsed.reasoning == "I should search."


def test_gpt_oss_as_the_model_writes_it_after_the_generation_prompt():
    text = (
        "<|channel|>analysis<|message|>Need the time.<|end|><|start|>assistant<|channel|>commentary "
        "to=functions.now <|constrain|>json<|message|>{}<|call|>"
    )
    parsed = parse_tool_calls(text, "openai")
    assert named(parsed) == [("now", {})] and parsed.reasoning == "Need the time."
    final = "<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final<|message|>It is 4.<|return|>"
    assert parse_tool_calls(final, "openai").content == "It is 4." and not parse_tool_calls(final).calls


@pytest.mark.parametrize(
    ("template", "format"), [("deepseek_v3", "deepseek_v3"), ("deepseek_v31", "deepseek_v31")]
)
def test_deepseek_round_trip(template, format):
    text = rendered_turn(
        template, CALLS, content="Looking.", end="<｜end▁of▁sentence｜>", arguments_as_json=True
    )
    for chosen in (format, "auto"):
        parsed = parse_tool_calls(text, chosen, TOOLS)
        assert named(parsed) == CALLS and parsed.content == "Looking."


@pytest.mark.parametrize("template", ["mistral_v3", "mistral_v11"])
def test_mistral_round_trip_with_ids_mistral_accepts(template):
    text = rendered_turn(template, CALLS, end="<eos>", ids=True)
    for format in ("mistral", "auto"):
        parsed = parse_tool_calls(text, format, TOOLS)
        assert named(parsed) == CALLS and parsed.content == ""
        assert all(len(call.id) == 9 and call.id.isalnum() for call in parsed.calls)


def test_text_before_and_after_calls_is_content():
    qwen = "Sure.\n<tool_call>\n<function=now>\n</function>\n</tool_call>\nthen more"
    deepseek = "Sure.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>now<｜tool▁sep｜>{}<｜tool▁call▁end｜><｜tool▁calls▁end｜> more"
    mistral = "Sure.[TOOL_CALLS]now[CALL_ID]a1b2c3d4e[ARGS]{} more"
    for text, format in ((qwen, "qwen3_coder"), (deepseek, "deepseek_v3"), (mistral, "mistral")):
        parsed = parse_tool_calls(text, format)
        assert named(parsed) == [("now", {})], format
        assert parsed.content.startswith("Sure.") and parsed.content.endswith("more"), format


@pytest.mark.parametrize(
    ("format", "text", "message"),
    [
        ("qwen3_coder", "<tool_call>\n<function=now>\n</function>", "not closed with </tool_call>"),
        (
            "qwen3_coder",
            "<tool_call>\n<function=search>\n<parameter=limit>\n3\n</function>\n</tool_call>",
            "not closed with </parameter>",
        ),
        (
            "qwen3_coder",
            "<tool_call>\n<function=search>\n<parameter=limit>\nthree\n</parameter>\n</function>\n</tool_call>",
            "must be integer",
        ),
        (
            "qwen3_coder",
            "<tool_call>\n<function=search>\n<parameter=exact>\nyes\n</parameter>\n</function>\n</tool_call>",
            "must be boolean",
        ),
        (
            "qwen3_coder",
            "<tool_call>\n<function=search>\n<parameter=filters>\n[1]\n</parameter>\n</function>\n</tool_call>",
            "must be object",
        ),
        ("qwen3_coder", "<tool_call>\n<function=>\n</function>\n</tool_call>", "names nothing"),
        ("qwen3_coder", "<tool_call>\n<function=now>\nhello\n</function>\n</tool_call>", "has text where"),
        (
            "openai",
            "<|channel|>commentary to=functions.now <|constrain|>json<|message|>{oops}<|call|>",
            "not valid JSON",
        ),
        (
            "openai",
            "<|channel|>commentary to=functions.now <|constrain|>json<|message|>[1]<|call|>",
            "not a JSON object",
        ),
        ("openai", "<|channel|>commentary to=functions.now", "has no <|message|>"),
        ("deepseek_v3", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>now<｜tool▁sep｜>{}", "not closed"),
        (
            "deepseek_v3",
            "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>now {}<｜tool▁call▁end｜>",
            "no <｜tool▁sep｜>",
        ),
        (
            "deepseek_v3",
            "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>now\n```json\n{x}\n```<｜tool▁call▁end｜>",
            "not valid JSON",
        ),
        (
            "deepseek_v3",
            "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜><｜tool▁sep｜>{}<｜tool▁call▁end｜>",
            "names no tool",
        ),
        ("deepseek_v3", "<｜tool▁calls▁begin｜>now<｜tool▁calls▁end｜>", "hold no"),
        ("mistral", '[TOOL_CALLS] [{"name": "now", "arguments": {}', "not valid JSON"),
        ("mistral", '[TOOL_CALLS] [{"arguments": {}}]', "names no tool"),
        ("mistral", '[TOOL_CALLS] [{"name": "now", "arguments": 3}]', "not a JSON object"),
        ("mistral", "[TOOL_CALLS]now{}", "no [ARGS]"),
        ("mistral", "[TOOL_CALLS]now[ARGS]{x}", "not valid JSON"),
    ],
)
def test_a_malformed_call_becomes_a_message_for_the_model(format, text, message):
    for chosen in (format, "auto"):
        calls = parse_tool_calls(text, chosen, TOOLS).calls
        assert len(calls) == 1 and isinstance(calls[0], MalformedToolCall), (chosen, calls)
        assert message in calls[0].message and "write " in calls[0].message and calls[0].text in text


def test_qwen3_coder_refuses_a_json_call_that_auto_reads_as_hermes():
    text = '<tool_call>\n{"name": "now"}\n</tool_call>'
    (call,) = parse_tool_calls(text, "qwen3_coder").calls
    assert isinstance(call, MalformedToolCall) and "does not start with <function=" in call.message
    assert named(parse_tool_calls(text)) == [("now", {})]


def test_good_and_malformed_calls_keep_their_order():
    text = (
        "<tool_call>\n<function=now>\n</function>\n</tool_call>"
        "<tool_call>\n<function=search>\n<parameter=limit>\nx\n</parameter>\n</function>\n</tool_call>"
        "<tool_call>\n<function=search>\n<parameter=limit>\n2\n</parameter>\n</function>\n</tool_call>"
    )
    calls = parse_tool_calls(text, "qwen3_coder", TOOLS).calls
    assert [type(call).__name__ for call in calls] == ["ToolCall", "MalformedToolCall", "ToolCall"]
    assert calls[2].arguments == {"limit": 2}


@pytest.mark.parametrize(
    ("template", "format"),
    [
        ("qwen3_coder", "qwen3_coder"),
        ("gpt_oss", "openai"),
        ("deepseek_v3", "deepseek_v3"),
        ("deepseek_v31", "deepseek_v3"),
        ("mistral_v3", "mistral"),
        ("mistral_v11", "mistral"),
    ],
)
def test_the_format_is_read_from_the_chat_template(template, format):
    assert format_of_template((TEMPLATES / f"{template}.jinja").read_text()) == format


def test_templates_without_a_known_format():
    assert format_of_template(None) == "auto" and format_of_template("{{ messages }}") == "auto"
    assert format_of_template('<tool_call>{"name": <function-name>}</tool_call>') == "hermes"
    assert format_of_template("{{ '<tool_call>' + tc.name }}<arg_key>") == "auto"
    assert format_of_template({"default": "x", "tool_use": "[TOOL_CALLS]"}) == "mistral"


def test_auto_is_resolved_from_the_tokenizer_template_and_logged(caplog):
    tokenizer = build_char_tokenizer()
    tokenizer.chat_template = (TEMPLATES / "qwen3_coder.jinja").read_text()
    with caplog.at_level(logging.INFO, logger="grpoflow.chat"):
        assert resolve_tool_call_format("auto", tokenizer) == "qwen3_coder"
        assert resolve_tool_call_format("hermes", tokenizer) == "hermes"
    assert [record.getMessage() for record in caplog.records] == [
        "tool_call_parser auto: qwen3_coder, from the chat template"
    ]
    with pytest.raises(
        ValueError, match="tool_call_parser must be one of hermes, qwen3_coder, .*, got 'qwen3'"
    ):
        resolve_tool_call_format("qwen3", tokenizer)


def test_auto_without_a_known_template_reads_each_turn_by_its_markers(caplog):
    tokenizer = build_char_tokenizer()
    tokenizer.chat_template = "{% for message in messages %}{{ message['content'] }}{% endfor %}"
    with caplog.at_level(logging.INFO, logger="grpoflow.chat"):
        assert resolve_tool_call_format("auto", tokenizer) == "auto"
    assert "no known tool-call format" in caplog.text and "qwen3_coder" in caplog.text
