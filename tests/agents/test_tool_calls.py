import pytest

from grpoflow.agents.tool_calls import MalformedToolCall, ToolCall, parse_tool_calls


def test_hermes_calls_and_the_content_around_them():
    text = (
        'Let me add.<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": {"c": [2, 3]}}}\n</tool_call>'
        '<tool_call>{"name": "now", "arguments": {}}</tool_call>'
    )
    parsed = parse_tool_calls(text, "hermes")
    assert parsed.content == "Let me add."
    assert [(c.name, c.arguments) for c in parsed.calls] == [
        ("add", {"a": 1, "b": {"c": [2, 3]}}),
        ("now", {}),
    ]
    assert all(c.id.startswith("call_") for c in parsed.calls) and parsed.calls[0].id != parsed.calls[1].id


def test_llama3_json_calls_with_python_tag_and_semicolons():
    text = '<|python_tag|>{"name": "add", "parameters": {"a": "x;y"}}; {"name": "now", "parameters": {}}'
    parsed = parse_tool_calls(text, "llama3_json")
    assert [(c.name, c.arguments) for c in parsed.calls] == [("add", {"a": "x;y"}), ("now", {})]
    assert parse_tool_calls("The answer is 4.", "llama3_json").calls == []


def test_auto_picks_the_format_and_plain_text_has_no_calls():
    assert parse_tool_calls('<tool_call>{"name": "f", "arguments": {}}</tool_call>').calls[0].name == "f"
    assert parse_tool_calls('{"name": "f", "parameters": {"x": 1}}').calls[0].arguments == {"x": 1}
    assert parse_tool_calls("no calls here").calls == []


def test_arguments_given_as_a_json_string_are_read():
    (call,) = parse_tool_calls('<tool_call>{"name": "f", "arguments": "{\\"x\\": 2}"}</tool_call>').calls
    assert call == ToolCall("f", {"x": 2}, call.id)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("<tool_call>{not json}</tool_call>", "not valid JSON"),
        ('<tool_call>{"arguments": {}}</tool_call>', "names no tool"),
        ('<tool_call>{"name": "f", "arguments": [1]}</tool_call>', "not a JSON object"),
        ('<tool_call>{"name": "f", "arguments": {}}', "not closed"),
        ('{"name": "f", "parameters": {}', "not valid JSON"),
    ],
)
def test_a_malformed_call_becomes_a_message_for_the_model(text, message):
    (call,) = parse_tool_calls(text).calls
    assert isinstance(call, MalformedToolCall) and message in call.message


def test_an_unknown_format_is_named():
    with pytest.raises(ValueError, match="tool_call_parser must be one of hermes, llama3_json, auto"):
        parse_tool_calls("x", "mistral")
